#include "sharc/runtime/device_storage.h"

#include <utility>

#include <c10/core/Allocator.h>

namespace sharc {

void allocate_storage(c10::Storage& storage, int64_t nbytes) {
  c10::Allocator* allocator = storage.allocator();
  if (allocator == nullptr) {
    allocator = c10::GetAllocator(storage.device_type());
  }
  storage.set_data_ptr_noswap(allocator->allocate(nbytes));
  storage.set_nbytes(nbytes);
  storage.unsafeGetStorageImpl()->clear_data_ptr_access_error_msg_();
}

void free_storage(c10::Storage& storage, std::string read_error) {
  storage.set_data_ptr_noswap(c10::DataPtr(nullptr, storage.device()));
  storage.set_nbytes(0);
  storage.unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
      std::move(read_error));
}

}  // namespace sharc
