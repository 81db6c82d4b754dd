#include <gtest/gtest.h>

#include "sharc/core/error.h"
#include "sharc/core/param_state.h"

namespace sharc {
namespace {

TEST(ParamStateMachine, FullCycle) {
  ParamStateMachine p("fc.weight");
  EXPECT_EQ(p.state(), ParamState::Sharded);
  p.begin_gather();
  EXPECT_EQ(p.state(), ParamState::Gathering);
  p.finish_gather();
  EXPECT_EQ(p.state(), ParamState::Gathered);
  p.acquire();
  EXPECT_TRUE(p.release());
  EXPECT_EQ(p.state(), ParamState::Released);
  p.begin_gather();  // a released parameter can be gathered again
  EXPECT_EQ(p.state(), ParamState::Gathering);
}

TEST(ParamStateMachine, LastHoldFrees) {
  ParamStateMachine p("tied.weight");
  p.begin_gather();
  p.finish_gather();
  p.acquire();
  p.acquire();
  EXPECT_EQ(p.holds(), 2);
  EXPECT_FALSE(p.release());  // first use done, second still needs it
  EXPECT_EQ(p.state(), ParamState::Gathered);
  EXPECT_TRUE(p.release());
  EXPECT_EQ(p.state(), ParamState::Released);
}

TEST(ParamStateMachine, PersistentStaysGathered) {
  ParamStateMachine p("kept");
  p.set_persistent(true);
  p.begin_gather();
  p.finish_gather();
  p.acquire();
  EXPECT_FALSE(p.release());
  EXPECT_EQ(p.state(), ParamState::Gathered);
  p.acquire();  // usable again without a new gather
  EXPECT_EQ(p.holds(), 1);
}

TEST(ParamStateMachine, MisuseNamesTheParameterAndState) {
  ParamStateMachine p("blocks.0.attn.weight");
  try {
    p.release();
    FAIL() << "release of a sharded parameter must throw";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("blocks.0.attn.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sharded"), std::string::npos) << msg;
  }
  EXPECT_THROW(p.finish_gather(), Error);  // waiting with nothing in flight
  EXPECT_THROW(p.acquire(), Error);        // use before gather
  p.begin_gather();
  EXPECT_THROW(p.begin_gather(), Error);   // second gather while in flight
  EXPECT_THROW(p.acquire(), Error);        // use before wait
  p.finish_gather();
  EXPECT_THROW(p.release(), Error);        // release without a hold
  EXPECT_THROW(p.begin_gather(), Error);   // gather what is already gathered
}

TEST(ParamStateMachine, StateNames) {
  EXPECT_STREQ(to_string(ParamState::Sharded), "sharded");
  EXPECT_STREQ(to_string(ParamState::Gathering), "gathering");
  EXPECT_STREQ(to_string(ParamState::Gathered), "gathered");
  EXPECT_STREQ(to_string(ParamState::Released), "released");
}

}  // namespace
}  // namespace sharc
