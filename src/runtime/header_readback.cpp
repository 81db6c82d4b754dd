#include "sharc/runtime/header_readback.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace sharc {

HeaderReadback::HeaderReadback(const at::Tensor& headers) {
  if (headers.is_cpu()) {
    host_ = headers.clone();  // the collective's buffer moves on after its wait
    return;
  }
  const c10::Device device = headers.device();
  host_ = at::empty(headers.sizes(),
                    headers.options().device(at::kCPU).pinned_memory(true));
  host_.copy_(headers, /*non_blocking=*/true);
  arrival_.emplace(device.type());
  arrival_->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
}

bool HeaderReadback::arrived() const { return !arrival_ || arrival_->query(); }

const at::Tensor& HeaderReadback::host() {
  if (arrival_) arrival_->synchronize();
  return host_;
}

}  // namespace sharc
