// The replicate group's gradient all-reduces and their agreement (see
// replicate_group.h and docs/design/hybrid-sharding.md).

#include "sharc/runtime/replicate_group.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "sharc/core/error.h"
#include "sharc/runtime/collective_headers.h"

namespace sharc {
namespace {

// The kind a replicate all-reduce has in its fingerprint: apart from the
// runtime's own kinds (0-2), so it never matches a shard-group collective.
constexpr int64_t kReplicateAllReduce = 3;

const char* const kAdvice =
    ". Every host must run the same sharded modules in the same order, with the same "
    "no_sync / defer_replicate settings";

}  // namespace

ReplicateGroup::ReplicateGroup(const std::string& group_name) : comm_(group_name) {}

int64_t ReplicateGroup::ring_bytes(int64_t bytes, int64_t world) {
  return 2 * (world - 1) * bytes / world;
}

int64_t ReplicateGroup::start(const std::vector<int64_t>& ids, const at::Tensor& payload,
                              bool verify) {
  RECORD_FUNCTION("sharc::start_replicate_all_reduce", std::vector<c10::IValue>());
  SHARC_CHECK(diverged_.empty(), diverged_, " (at an earlier all-reduce: the replicate group "
              "cannot communicate any more)");
  SHARC_CHECK(!ids.empty() && payload.dim() == 1, "sharc: a replicate all-reduce needs "
              "parameters and a flat payload");
  // Settle what must be settled before planning, oldest first.
  settle_arrived();
  while (auto seq = agreement_.unsettled_before_next()) {
    if (arriving_.count(*seq)) {
      settle_arriving(*seq);
      continue;
    }
    auto it = in_flight_.find(*seq);
    SHARC_CHECK(it != in_flight_.end(), "sharc: the replicate all-reduce numbered ", *seq,
                " in group '", comm_.group_name(), "' was dropped before it completed");
    settle(*seq, it->second);
  }
  const int64_t bits = CollectiveHeader::kBits;
  const int64_t numel = payload.numel() + bits;
  const WireShape shape{WireShape::kAllToAll, static_cast<int64_t>(payload.scalar_type()),
                        numel};
  uint64_t fingerprint =
      CollectiveAgreement::fingerprint(kReplicateAllReduce, shape.dtype, ids);
  fingerprint ^= shape.pack() * 0x9e3779b97f4a7c15ULL;
  auto issue = agreement_.plan(fingerprint, shape, kReplicateAllReduce,
                               static_cast<int64_t>(ids.size()), ids[0], verify);
  if (issue.plan == CollectiveAgreement::Plan::kExchange) {
    exchange_headers(issue.header, payload.device());
  } else if (issue.plan == CollectiveAgreement::Plan::kDecoy) {
    send_decoy(issue, payload.device());
  }
  InFlight flight;
  flight.payload = payload.numel();
  flight.wire = at::empty({numel}, payload.options());
  flight.wire.narrow(0, 0, payload.numel()).copy_(payload);
  write_header_bits(flight.wire.narrow(0, payload.numel(), bits).view({1, bits}), issue.header);
  flight.work = comm_.all_reduce_sum(flight.wire);
  const int64_t world = comm_.world_size();
  sent_bytes_ += ring_bytes(static_cast<int64_t>(payload.nbytes()), world);
  header_bytes_ += ring_bytes(bits * static_cast<int64_t>(payload.element_size()), world);
  ++calls_;
  in_flight_.emplace(issue.seq, std::move(flight));
  return issue.seq;
}

c10::intrusive_ptr<c10d::Work> ReplicateGroup::work(int64_t seq) const {
  auto it = in_flight_.find(seq);
  return it == in_flight_.end() ? c10::intrusive_ptr<c10d::Work>() : it->second.work;
}

void ReplicateGroup::settle_before(int64_t seq) {
  for (auto it = in_flight_.begin(); it != in_flight_.end() && it->first < seq; ++it) {
    settle(it->first, it->second);
  }
  while (!arriving_.empty() && arriving_.begin()->first < seq) {
    settle_arriving(arriving_.begin()->first);
  }
}

at::Tensor ReplicateGroup::finish(int64_t seq) {
  auto it = in_flight_.find(seq);
  SHARC_CHECK(it != in_flight_.end(), "sharc: no replicate all-reduce numbered ", seq,
              " is in flight in group '", comm_.group_name(), "'");
  InFlight flight = std::move(it->second);
  in_flight_.erase(it);
  settle(seq, flight);
  return flight.wire.narrow(0, 0, flight.payload);
}

void ReplicateGroup::settle(int64_t seq, InFlight& flight) {
  if (flight.work) {
    flight.work->wait();
    release_waited(flight.work);
    flight.work.reset();
  }
  if (agreement_.settled(seq) || arriving_.count(seq)) return;
  const int64_t bits = CollectiveHeader::kBits;
  const at::Tensor sums = flight.wire.narrow(0, flight.payload, bits);
  if (settle_on_arrival_.value_or(!sums.is_cpu())) {  // see header_readback.h
    arriving_.emplace(seq, HeaderReadback(sums));
    return;
  }
  judge(seq, read_header_bits(sums));
}

void ReplicateGroup::settle_arriving(int64_t seq) {
  auto it = arriving_.find(seq);
  if (it == arriving_.end()) return;
  const at::Tensor host = it->second.host();  // waits if still on its way
  arriving_.erase(it);
  judge(seq, parse_header_bits(host));
}

void ReplicateGroup::settle_arrived() {
  while (!arriving_.empty() && arriving_.begin()->second.arrived()) {
    settle_arriving(arriving_.begin()->first);
  }
}

void ReplicateGroup::settle_all() {
  while (!arriving_.empty()) settle_arriving(arriving_.begin()->first);
}

void ReplicateGroup::judge(int64_t seq, const std::vector<int64_t>& sums) {
  const Verdict verdict = agreement_.settle_bits(seq, sums, comm_.world_size());
  if (verdict.kind != Verdict::kAgree) {
    diverged(detail::concat("rank ", comm_.rank(), " of replicate group '", comm_.group_name(),
                            "' all-reduced gradients unlike its replicas (the hosts reduced "
                            "different gradients)"));
  }
}

void ReplicateGroup::exchange_headers(const CollectiveHeader& mine, c10::Device device) {
  RECORD_FUNCTION("sharc::agree_replicas", std::vector<c10::IValue>());
  const Verdict verdict = CollectiveAgreement::judge(
      headers_of_rows(exchange_header_rows(comm_, mine, device)), comm_.rank());
  if (verdict.kind == Verdict::kAgree) return;
  diverged(detail::concat("rank ", comm_.rank(), " is about to all-reduce ", mine.count,
                          " parameter gradients over replicate group '", comm_.group_name(),
                          "' while its replica ", verdict.other, " (in that group) all-reduces ",
                          verdict.theirs.count));
}

void ReplicateGroup::send_decoy(const CollectiveAgreement::Issue& issue, c10::Device device) {
  RECORD_FUNCTION("sharc::decoy_replicas", std::vector<c10::IValue>());
  const auto dtype = static_cast<c10::ScalarType>(issue.wire.dtype);
  const int64_t numel = issue.wire.numel, bits = CollectiveHeader::kBits;
  CollectiveHeader header = issue.header;
  header.decoy = true;
  at::Tensor wire = at::zeros({numel}, at::TensorOptions().dtype(dtype).device(device));
  write_header_bits(wire.narrow(0, numel - bits, bits).view({1, bits}), header);
  wait_and_release(comm_.all_reduce_sum(wire));
  const Verdict verdict = CollectiveAgreement::judge_bits(
      read_header_bits(wire.narrow(0, numel - bits, bits)), comm_.world_size());
  if (verdict.kind == Verdict::kDiverged) {
    diverged(detail::concat("rank ", comm_.rank(), " of replicate group '", comm_.group_name(),
                            "' meant to all-reduce gradients unlike its replicas"));
  }
}

void ReplicateGroup::diverged(const std::string& detail) {
  diverged_ = "sharc: the hosts diverged: " + detail + kAdvice;
  throw Error(diverged_);
}

}  // namespace sharc
