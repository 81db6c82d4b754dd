#pragma once
// The replicate dimension of a hybrid-sharded runtime (see
// docs/design/hybrid-sharding.md).
//
// With a 2-D mesh ("replicate", "shard"), a runtime's own group is the
// shard group: parameters are sharded over it and gradients reduce-scattered
// in it. Ranks holding the same shards in different shard groups form a
// replicate group; after each reduce-scatter the shard gradients are summed
// over it with an all-reduce. This class owns that group's communicator and
// its own agreement state: the replicate group is another group, with its
// own sequence of collectives, so its all-reduces are planned and settled
// with a CollectiveAgreement of their own (sizes agreed before they go on
// the wire, every replica's header carried inside each one as bit sums),
// exactly as the shard group's collectives are. Not thread-safe: the
// Runtime calls it with its own lock held.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "sharc/core/collective_agreement.h"
#include "sharc/runtime/communicator.h"
#include "sharc/runtime/header_readback.h"

namespace sharc {

class ReplicateGroup {
 public:
  explicit ReplicateGroup(const std::string& group_name);

  int64_t world_size() const { return comm_.world_size(); }
  const std::string& group_name() const { return comm_.group_name(); }

  /// Starts the sum over the replicate group of `payload` (1-D, any float
  /// dtype: shard gradients and the non-finite flag) for the parameters
  /// `ids`. Returns the collective's seq; `payload_of(seq)` is the summed
  /// payload once finish(seq) returned. Plans it with the replicas first
  /// (may block for a header exchange or a decoy; throws where they diverged).
  /// `verify` (ShardConfig.verify_schedule) exchanges headers first always.
  int64_t start(const std::vector<int64_t>& ids, const at::Tensor& payload, bool verify);
  /// The work to wait on for `seq` (null once finished).
  c10::intrusive_ptr<c10d::Work> work(int64_t seq) const;
  /// Waits (if not yet) and settles `seq`; throws where the replicas
  /// diverged. Returns the summed payload and forgets the collective.
  at::Tensor finish(int64_t seq);
  /// Settles, oldest first, every all-reduce started before `seq`: called
  /// before the host blocks on `seq` (see [Note: settle in order] in
  /// runtime_agreement.cpp). A replica that judged an earlier one diverged
  /// has raised and never starts `seq`; judging in start order makes this
  /// replica raise too instead of waiting on it until the transport fails.
  void settle_before(int64_t seq);

  /// Where an all-reduce is settled, as Runtime::set_settle_on_arrival
  /// says for the shard group: at its finish, or once its headers arrive
  /// on the host (unset: on a device only).
  void set_settle_on_arrival(std::optional<bool> on_arrival) { settle_on_arrival_ = on_arrival; }
  /// Settles every finished all-reduce, waiting for headers on their way.
  void settle_all();

  int64_t sent_bytes() const { return sent_bytes_; }
  int64_t header_bytes() const { return header_bytes_; }
  int64_t calls() const { return calls_; }
  void reset_stats() { sent_bytes_ = header_bytes_ = calls_ = 0; }

  /// What a ring all-reduce of `bytes` sends from each of `world` ranks:
  /// a reduce-scatter and an all-gather of world slices, 2 (world-1)/world
  /// of the bytes (exact where world divides them; 1x for two replicas).
  static int64_t ring_bytes(int64_t bytes, int64_t world);

 private:
  struct InFlight {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor wire;  ///< payload, then the header's bits (summed over replicas)
    int64_t payload = 0;
  };
  /// Waits for collective `seq` and settles it from the bit sums in its
  /// wire, or starts reading them back (settled on arrival).
  void settle(int64_t seq, InFlight& flight);
  /// Settles `seq` from its bit sums on their way to the host, if they are.
  void settle_arriving(int64_t seq);
  /// Settles, in order, the all-reduces whose headers have arrived.
  void settle_arrived();
  void judge(int64_t seq, const std::vector<int64_t>& sums);
  void exchange_headers(const CollectiveHeader& mine, c10::Device device);
  void send_decoy(const CollectiveAgreement::Issue& issue, c10::Device device);
  [[noreturn]] void diverged(const std::string& detail);

  Communicator comm_;
  CollectiveAgreement agreement_;
  std::map<int64_t, InFlight> in_flight_;
  std::map<int64_t, HeaderReadback> arriving_;  ///< finished, headers on their way
  std::optional<bool> settle_on_arrival_;
  std::string diverged_;
  int64_t sent_bytes_ = 0, header_bytes_ = 0, calls_ = 0;
};

}  // namespace sharc
