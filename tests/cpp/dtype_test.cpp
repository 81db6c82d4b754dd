// The compiler's dtype table.

#include <gtest/gtest.h>

#include "sharc/compiler/dtype.h"

namespace sharc::ir {
namespace {

int64_t size_of(std::string_view name) { return dtype_info(name).value().element_bytes; }
bool floating(std::string_view name) { return dtype_info(name).value().floating; }

TEST(Dtype, ElementSizes) {
  EXPECT_EQ(size_of("float64"), 8);
  EXPECT_EQ(size_of("float32"), 4);
  EXPECT_EQ(size_of("float16"), 2);
  EXPECT_EQ(size_of("bfloat16"), 2);
  EXPECT_EQ(size_of("float8_e4m3fn"), 1);
  EXPECT_EQ(size_of("float8_e5m2"), 1);
  EXPECT_EQ(size_of("int64"), 8);
  EXPECT_EQ(size_of("int32"), 4);
  EXPECT_EQ(size_of("int16"), 2);
  EXPECT_EQ(size_of("int8"), 1);
  EXPECT_EQ(size_of("uint8"), 1);
  EXPECT_EQ(size_of("bool"), 1);
  EXPECT_EQ(size_of("complex64"), 8);
  EXPECT_EQ(size_of("complex128"), 16);
}

TEST(Dtype, FloatingPointTypes) {
  for (const char* name : {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                           "float8_e5m2"}) {
    EXPECT_TRUE(floating(name)) << name;
  }
  for (const char* name : {"int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
                           "complex128"}) {
    EXPECT_FALSE(floating(name)) << name;
  }
}

TEST(Dtype, UnknownNamesAreUnknown) {
  EXPECT_FALSE(dtype_info("torch.float32").has_value());  // the prefix is dropped
  EXPECT_FALSE(dtype_info("half").has_value());           // an alias, not str(dtype)
  EXPECT_FALSE(dtype_info("Float32").has_value());
  EXPECT_FALSE(dtype_info("").has_value());
}

TEST(Dtype, NamesAreIdentifiers) {
  EXPECT_TRUE(is_dtype_name("bfloat16"));
  EXPECT_TRUE(is_dtype_name("float8_e4m3fnuz"));  // unknown, still a name
  EXPECT_TRUE(is_dtype_name("_x"));
  EXPECT_FALSE(is_dtype_name(""));
  EXPECT_FALSE(is_dtype_name("8bit"));
  EXPECT_FALSE(is_dtype_name("torch.float32"));
  EXPECT_FALSE(is_dtype_name("@0"));
  EXPECT_FALSE(is_dtype_name("%x"));
  EXPECT_FALSE(is_dtype_name("float32\""));
}

}  // namespace
}  // namespace sharc::ir
