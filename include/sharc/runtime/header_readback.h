#pragma once
// A collective's headers on their way back to the host (see [Note:
// collective agreement] in sharc/core/collective_agreement.h).
//
// On a device, reading the headers back at a collective's wait would make
// the host wait for every kernel queued on the stream before that point: a
// full drain of the GPU at every collective. So there the header bytes are
// copied, in stream order just behind the wait, into pinned host memory,
// and an event marks their arrival; the runtime settles the collective once
// they have arrived, and at the latest before the collective kLag later is
// planned (its shape was announced in these headers). A divergence is
// therefore still raised on every rank, at most kLag collectives after the
// one where the ranks parted. On the host the bytes are simply copied.

#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

namespace sharc {

class HeaderReadback {
 public:
  /// Starts copying `headers` (any device) to the host, ordered on the
  /// current stream of its device.
  explicit HeaderReadback(const at::Tensor& headers);

  /// Whether the bytes are on the host; never blocks.
  bool arrived() const;

  /// The bytes on the host, waiting for them if they are still on their way.
  const at::Tensor& host();

 private:
  at::Tensor host_;
  std::optional<c10::Event> arrival_;  ///< none on the host
};

}  // namespace sharc
