#include "sharc/runtime/device_storage.h"

#include <type_traits>
#include <utility>

#include <c10/core/Allocator.h>

namespace sharc {
namespace {

// Lifting the released-read error. torch 2.13 has a public call for it;
// older releases (2.11 on the GPU machines) set the flag behind the error in
// release_data_and_set_meta_custom_data_ptr_error_msg_ and never clear it.
// There, the flag is reset through the one access path C++ leaves to private
// members (an explicit template instantiation names them without an access
// check); it is compiled in both, and only called where the public call is
// missing.
struct ThrowOnReadFlag {
  using type = bool c10::StorageImpl::*;
};
struct RefreshDataPtrCheck {
  using type = void (c10::StorageImpl::*)();
};
template <typename Tag, typename Tag::type Member>
struct PrivateMember {
  friend typename Tag::type member(Tag) { return Member; }
};
ThrowOnReadFlag::type member(ThrowOnReadFlag);
RefreshDataPtrCheck::type member(RefreshDataPtrCheck);
template struct PrivateMember<ThrowOnReadFlag, &c10::StorageImpl::throw_on_immutable_data_ptr_>;
template struct PrivateMember<RefreshDataPtrCheck, &c10::StorageImpl::refresh_has_data_ptr_check>;

template <typename Impl, typename = void>
struct HasPublicClear : std::false_type {};
template <typename Impl>
struct HasPublicClear<Impl, std::void_t<decltype(std::declval<Impl&>()
                                                     .clear_data_ptr_access_error_msg_())>>
    : std::true_type {};

template <typename Impl>
void lift_read_error(Impl& impl) {
  if constexpr (HasPublicClear<Impl>::value) {
    impl.clear_data_ptr_access_error_msg_();
  } else {
    impl.*member(ThrowOnReadFlag{}) = false;  // the message stays, unread
    (impl.*member(RefreshDataPtrCheck{}))();
  }
}

}  // namespace

void allocate_storage(c10::Storage& storage, int64_t nbytes) {
  c10::Allocator* allocator = storage.allocator();
  if (allocator == nullptr) {
    allocator = c10::GetAllocator(storage.device_type());
  }
  storage.set_data_ptr_noswap(allocator->allocate(nbytes));
  storage.set_nbytes(nbytes);
  lift_read_error(*storage.unsafeGetStorageImpl());
}

void free_storage(c10::Storage& storage, std::string read_error) {
  storage.set_data_ptr_noswap(c10::DataPtr(nullptr, storage.device()));
  storage.set_nbytes(0);
  storage.unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
      std::move(read_error));
}

}  // namespace sharc
