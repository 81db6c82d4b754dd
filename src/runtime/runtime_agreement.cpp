// The Runtime's part in agreeing on every collective (see [Note: collective
// agreement] in sharc/core/collective_agreement.h): planning each one with
// the other ranks, settling it when it completes, and the errors.

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "sharc/core/error.h"
#include "sharc/runtime/collective_headers.h"
#include "sharc/runtime/runtime.h"

namespace sharc {
namespace {

// Indexed by Runtime::Collective.
const char* const kCollectiveKinds[] = {"all-gather", "reduce-scatter", "full read"};
const char* const kArticles[] = {"an ", "a ", "a "};

const char* const kDivergedAdvice =
    ". Every rank must run the same sharded modules in the same order: the same number "
    "of forward and backward passes (an extra evaluation batch or micro-batch on one rank "
    "parts them), and a module whose submodules run on some ranks only (mixture-of-experts "
    "routing) must be named in ShardConfig.gather_units. A gather unit joins backward only "
    "on ranks where a gradient reaches its output, so on every rank its output must "
    "depend on its parameters and reach the loss (a unit given no rows on one rank, whose "
    "output there is a constant, parts the ranks). Eager, an output of a module every "
    "rank runs must likewise reach the loss on every rank or on none: a term some ranks "
    "leave out of their loss (an auxiliary loss their data skips) is added there as "
    "`loss + 0 * aux`, so that its backward runs with a zero gradient. Compiled, ranks "
    "whose input sizes differ recompile at different steps, and Dynamo may split a "
    "recompiled frame at other graph breaks than the graph another rank still runs: "
    "compile with torch.compile(..., dynamic=True) (or torch._dynamo.mark_dynamic on the "
    "dimension that varies), so that every rank traces the same graphs";

}  // namespace

void Runtime::set_verify_schedule(bool verify) {
  std::lock_guard<std::mutex> lock(mutex_);
  verify_schedule_ = verify;
}

std::string Runtime::describe(int64_t kind, int64_t count, int64_t first) const {
  const bool known = kind >= 0 && kind < 3 && first >= 0 &&
                     first < static_cast<int64_t>(params_.size());
  if (!known) return "an unknown collective";
  std::string text = std::string(kArticles[kind]) + kCollectiveKinds[kind] + " of '" +
                     params_[first]->name + "'";
  if (count > 1) text += " and " + std::to_string(count - 1) + " more";
  return text;
}

CollectiveAgreement::Issue Runtime::agree_locked(Collective kind, const std::vector<int64_t>& ids,
                                                 const WireShape& shape, c10::Device device) {
  SHARC_CHECK(diverged_.empty(), diverged_, " (at an earlier collective: this group's sharded "
              "modules cannot communicate any more)");
  settle_arrived_locked();
  while (auto seq = agreement_.unsettled_before_next()) settle_locked(*seq);
  if (kind == kFullRead) settle_all_locked();  // a full read is what a step wrote
  uint64_t fingerprint = CollectiveAgreement::fingerprint(kind, shape.dtype, ids);
  fingerprint ^= shape.pack() * 0x9e3779b97f4a7c15ULL;  // held gradients change the shape
  auto issue = agreement_.plan(fingerprint, shape, kind, static_cast<int64_t>(ids.size()),
                               ids[0], verify_schedule_);
  if (issue.plan != CollectiveAgreement::Plan::kDirect) accounting_.on_agreement_call();
  // Each of these blocks this rank until every rank joins it.
  if (issue.plan != CollectiveAgreement::Plan::kDirect || kind == kFullRead) {
    settle_before_locked(issue.seq);
  }
  switch (issue.plan) {
    case CollectiveAgreement::Plan::kExchange:
      exchange_headers_locked(issue.header, ids, device);
      break;
    case CollectiveAgreement::Plan::kDecoy: {
      const Verdict verdict = send_decoy_locked(issue, device);
      if (verdict.kind == Verdict::kDiverged) diverged_locked(verdict, issue.header);
      break;  // every rank sent a decoy alike: each issues its real collective
    }
    case CollectiveAgreement::Plan::kDirect:
      break;
  }
  return issue;
}

void Runtime::settle_locked(int64_t seq) {
  if (auto it = unsettled_gathers_.find(seq); it != unsettled_gathers_.end()) {
    std::shared_ptr<GatherInFlight> gather = it->second.lock();
    SHARC_CHECK(gather, "sharc: the all-gather numbered ", seq, " in group '",
                comm_.group_name(), "' was dropped before it completed");
    finish_gather_locked(*gather);  // settles it, or starts reading its headers back
  } else if (!arriving_.count(seq)) {
    auto token = unsettled_reductions_.find(seq);
    SHARC_CHECK(token != unsettled_reductions_.end(), "sharc: no collective numbered ", seq,
                " is in flight in group '", comm_.group_name(), "'");
    auto it = reductions_.find(token->second);
    SHARC_CHECK(it != reductions_.end(), "sharc: the reduce-scatter numbered ", seq,
                " in group '", comm_.group_name(), "' was dropped before it completed");
    // Waited again by wait_reduce_scatter; summed whole here, so that the
    // received rows do not stay alive until then.
    it->second.work->wait();
    Communicator::sum_unsummed_rows(*it->second.work);
    settle_reduction_locked(it->second);
  }
  settle_arriving_locked(seq);
}

// [Note: settle in order]
// Up to kLag collectives may be in flight unsettled, and a rank need not
// wait on them in the order it issued them (a gather started ahead is
// waited on when its module or graph runs). If the ranks diverged at
// collective m, a rank that judges m raises there and issues nothing more;
// a rank that meanwhile blocks on a later collective (a decoy, a header
// exchange, a host wait on m + 1) would wait for a partner that has left,
// and end on the backend's error or timeout instead of the divergence. So
// before a decoy, an exchange or a full read (rare: where the schedule
// changes) a rank settles every earlier collective, and before a host wait
// every earlier gather: those are what ranks wait on out of order (started
// ahead), and they are waited on in order anyway, so that costs nothing.
// Earlier reductions are not waited for there: a compiled backward leaves
// them in flight until the end of backward, and waiting for them at each
// gather measurably slowed the GPT (4% a step). Instead, when a host wait
// fails (the rank that raised has left, and the backend says so), the
// earlier reductions are waited for and settled before the backend's
// error goes up, so a divergence among them is what this rank reports.
// On a device a wait only orders streams, and headers settle on arrival.
// The replicate group (hybrid sharding) has only all-reduces, started as
// each bucket's reduce-scatter is waited on and waited on where the schedule
// says, not always in start order: before a host wait on one, every earlier
// one is settled (ReplicateGroup::settle_before), so a replica that raised
// at an earlier all-reduce is never waited for at a later one.
void Runtime::settle_before_locked(int64_t seq, bool gathers_only) {
  std::vector<int64_t> earlier;
  for (const auto& entry : unsettled_gathers_) {
    if (entry.first < seq) earlier.push_back(entry.first);
  }
  if (!gathers_only) {
    for (const auto& entry : unsettled_reductions_) {
      if (entry.first < seq) earlier.push_back(entry.first);
    }
    for (const auto& entry : arriving_) {
      if (entry.first < seq) earlier.push_back(entry.first);
    }
  }
  std::sort(earlier.begin(), earlier.end());
  earlier.erase(std::unique(earlier.begin(), earlier.end()), earlier.end());
  for (int64_t s : earlier) {
    const bool pending = unsettled_gathers_.count(s) || unsettled_reductions_.count(s) ||
                         arriving_.count(s);
    if (pending) settle_locked(s);  // an earlier settle may have finished it
  }
}

void Runtime::explain_failed_wait_locked(int64_t seq) {
  const std::map<int64_t, int64_t> earlier(unsettled_reductions_.begin(),
                                           unsettled_reductions_.lower_bound(seq));
  for (const auto& [s, token] : earlier) {
    auto it = reductions_.find(token);
    if (it == reductions_.end() || !it->second.work) continue;
    // Every rank issued it or it fails now that a rank left, so the wait
    // ends; it is also what fills the wire on the host (the sum after an
    // all-to-all runs in wait()).
    try {
      it->second.work->wait();
    } catch (const std::exception&) {
      continue;  // never completed: nothing to judge
    }
    settle_reduction_locked(it->second);  // throws where the ranks diverged
  }
}

void Runtime::settle_reduction_locked(const PendingReduction& pending) {
  if (settled_or_arriving(pending.seq)) return;
  unsettled_reductions_.erase(pending.seq);
  const int64_t bits = CollectiveHeader::kBits;
  const at::Tensor sums = pending.wire.narrow(0, pending.wire.numel() - bits, bits);
  if (settles_on_arrival(sums)) {
    arriving_.emplace(pending.seq, ArrivingHeaders{HeaderReadback(sums), true});
    return;
  }
  const Verdict verdict =
      agreement_.settle_bits(pending.seq, read_header_bits(sums), comm_.world_size());
  if (verdict.kind != Verdict::kAgree) diverged_locked(verdict, {});
}

void Runtime::set_settle_on_arrival(bool on_arrival) {
  std::lock_guard<std::mutex> lock(mutex_);
  settle_on_arrival_ = on_arrival;
  if (replicate_) replicate_->set_settle_on_arrival(on_arrival);
}

bool Runtime::settles_on_arrival(const at::Tensor& wire) const {
  return settle_on_arrival_.value_or(!wire.is_cpu());
}

bool Runtime::settled_or_arriving(int64_t seq) const {
  return agreement_.settled(seq) || arriving_.count(seq) > 0;
}

void Runtime::settle_arriving_locked(int64_t seq) {
  auto it = arriving_.find(seq);
  if (it == arriving_.end()) return;
  const at::Tensor host = it->second.headers.host();  // waits if still on its way
  const bool bit_sums = it->second.bit_sums;
  arriving_.erase(it);
  if (bit_sums) {
    const Verdict verdict = agreement_.settle_bits(seq, parse_header_bits(host),
                                                   comm_.world_size());
    if (verdict.kind != Verdict::kAgree) diverged_locked(verdict, {});
    return;
  }
  const auto rows = parse_headers(host);
  const Verdict verdict = agreement_.settle(seq, rows, comm_.rank());
  if (verdict.kind != Verdict::kAgree) {
    diverged_locked(verdict, rows.at(static_cast<size_t>(comm_.rank())));
  }
}

void Runtime::settle_arrived_locked() {
  while (!arriving_.empty() && arriving_.begin()->second.headers.arrived()) {
    settle_arriving_locked(arriving_.begin()->first);
  }
}

void Runtime::settle_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  settle_all_locked();
}

void Runtime::settle_all_locked() {
  while (!arriving_.empty()) settle_arriving_locked(arriving_.begin()->first);
  if (replicate_) replicate_->settle_all();
}

void Runtime::settle_read_locked(int64_t seq, const at::Tensor& wire) {
  const auto rows = read_headers(wire, comm_.world_size());
  const Verdict verdict = agreement_.settle(seq, rows, comm_.rank());
  if (verdict.kind != Verdict::kAgree) diverged_locked(verdict, rows.at(comm_.rank()));
}

void Runtime::diverged_locked(const Verdict& verdict, const CollectiveHeader& mine) {
  std::string text;
  if (verdict.other >= 0) {
    text = detail::concat("sharc: the ranks diverged: rank ", comm_.rank(), " issued ",
                          describe(mine.kind, mine.count, mine.first), " while rank ",
                          verdict.other, " issued ",
                          describe(verdict.theirs.kind, verdict.theirs.count, verdict.theirs.first),
                          kDivergedAdvice);
  } else if (verdict.kind == Verdict::kRedo) {
    text = "sharc: the ranks diverged: every rank sent a decoy where it expected a real "
           "collective (a sharc bug: please report it)";
  } else {
    text = detail::concat("sharc: the ranks diverged: rank ", comm_.rank(), "'s collective "
                          "does not match what every other rank issued at the same point (a "
                          "reduce-scatter: the ranks reduced different gradients)",
                          kDivergedAdvice);
  }
  diverged_ = text;
  throw Error(text);
}

Verdict Runtime::send_decoy_locked(const CollectiveAgreement::Issue& issue, c10::Device device) {
  RECORD_FUNCTION("sharc::decoy", std::vector<c10::IValue>());
  const int64_t world = comm_.world_size();
  const auto dtype = static_cast<c10::ScalarType>(issue.wire.dtype);
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(device);
  CollectiveHeader header = issue.header;
  header.decoy = true;
  const int64_t numel = issue.wire.numel;
  if (issue.wire.op == WireShape::kAllGather) {
    at::Tensor input = at::zeros({numel}, options);
    const int64_t elements = header_elements(dtype);
    write_header(input.narrow(0, numel - elements, elements), header);
    at::Tensor wire = at::empty({world * numel}, options);
    wait_and_release(comm_.all_gather(wire, input));
    return CollectiveAgreement::judge(read_headers(wire, world), comm_.rank());
  }
  const int64_t width = numel / world, bits = CollectiveHeader::kBits;
  at::Tensor input = at::zeros({world, width}, options);
  write_header_bits(input.narrow(1, width - bits, bits), header);
  at::Tensor flat = input.view({-1});
  at::Tensor wire = at::empty({width}, options);
  wait_and_release(comm_.reduce_scatter_sum(wire, flat));
  return CollectiveAgreement::judge_bits(read_header_bits(wire.narrow(0, width - bits, bits)),
                                         world);
}

void Runtime::exchange_headers_locked(const CollectiveHeader& mine,
                                      const std::vector<int64_t>& ids, c10::Device device) {
  RECORD_FUNCTION("sharc::agree", std::vector<c10::IValue>());
  const at::Tensor rows = exchange_header_rows(comm_, mine, device);
  const Verdict verdict = CollectiveAgreement::judge(headers_of_rows(rows), comm_.rank());
  if (verdict.kind == Verdict::kAgree) return;
  // The same answer on every rank (they all saw `rows`): name the first
  // parameter where the lists part, with one more exchange on every rank.
  const std::string where = first_difference_locked(ids, rows, verdict.other, device);
  diverged_ = detail::concat(
      "sharc: the ranks diverged: rank ", comm_.rank(), " is about to issue ",
      describe(mine.kind, mine.count, mine.first), " while rank ", verdict.other, " issues ",
      describe(verdict.theirs.kind, verdict.theirs.count, verdict.theirs.first), where,
      kDivergedAdvice);
  throw Error(diverged_);
}

// Every rank calls it once the ranks' headers differ: the full parameter
// lists, padded to the longest, are exchanged (one more all-gather, on the
// way to an error) to name the first parameter where this rank's list and
// rank `other`'s part.
std::string Runtime::first_difference_locked(const std::vector<int64_t>& ids, const at::Tensor& rows,
                                             int64_t other, c10::Device device) {
  const int64_t world = comm_.world_size();
  const int64_t longest = std::max<int64_t>(rows.select(1, 4).max().item<int64_t>(), 1);
  at::Tensor mine = at::full({longest}, -1, at::kLong);
  for (size_t i = 0; i < ids.size(); ++i) mine[static_cast<int64_t>(i)] = ids[i];
  mine = mine.to(device);
  at::Tensor all = at::empty({world * longest}, mine.options());
  wait_and_release(comm_.all_gather(all, mine));
  at::Tensor lists = all.view({world, longest}).cpu();
  const auto* a = lists[comm_.rank()].const_data_ptr<int64_t>();
  const auto* b = lists[other].const_data_ptr<int64_t>();
  auto name = [this](int64_t id) {
    return id < 0 || id >= static_cast<int64_t>(params_.size())
               ? std::string("nothing")
               : "'" + params_[id]->name + "'";
  };
  for (int64_t i = 0; i < longest; ++i) {
    if (a[i] == b[i]) continue;
    return detail::concat("; their parameters first differ at position ", i + 1, ": ",
                          name(a[i]), " here, ", name(b[i]), " on rank ", other);
  }
  return "";  // the same parameters: the kind of collective differs
}

}  // namespace sharc
