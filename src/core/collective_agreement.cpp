#include "sharc/core/collective_agreement.h"

#include "sharc/core/error.h"

namespace sharc {
namespace {

constexpr uint64_t kFnvOffset = 1469598103934665603ULL;
constexpr uint64_t kFnvPrime = 1099511628211ULL;

uint64_t mix(uint64_t hash, uint64_t value) { return (hash ^ value) * kFnvPrime; }

constexpr int kFingerprintBits = 32;
constexpr int kDecoyBit = 32;
constexpr int kHasNextBit = 33;
constexpr int kNextBits = 34;  // the first of 64

}  // namespace

uint64_t WireShape::pack() const {
  SHARC_CHECK(op >= 0 && op < 4 && dtype >= 0 && dtype < 256 && numel >= 0 &&
                  numel < (int64_t{1} << 54),
              "sharc: a collective of ", numel, " elements (op ", op, ", dtype ", dtype,
              ") does not fit a collective header");
  return static_cast<uint64_t>(op) | static_cast<uint64_t>(dtype) << 2 |
         static_cast<uint64_t>(numel) << 10;
}

WireShape WireShape::unpack(uint64_t word) {
  return {static_cast<int64_t>(word & 3), static_cast<int64_t>((word >> 2) & 255),
          static_cast<int64_t>(word >> 10)};
}

std::string WireShape::to_string() const {
  return detail::concat(op == kAllGather ? "all-gather" : "all-to-all", " of ", numel,
                        " elements of dtype ", dtype);
}

std::array<int64_t, CollectiveHeader::kWords> CollectiveHeader::words() const {
  const int64_t flags = (decoy ? 1 : 0) | (next ? 2 : 0);
  return {static_cast<int64_t>(fingerprint), next ? static_cast<int64_t>(next->pack()) : 0,
          flags, kind, count, first};
}

CollectiveHeader CollectiveHeader::from_words(const int64_t* w) {
  CollectiveHeader h;
  h.fingerprint = static_cast<uint64_t>(w[0]);
  if (w[2] & 2) h.next = WireShape::unpack(static_cast<uint64_t>(w[1]));
  h.decoy = (w[2] & 1) != 0;
  h.kind = w[3];
  h.count = w[4];
  h.first = w[5];
  return h;
}

std::array<uint8_t, CollectiveHeader::kBits> CollectiveHeader::bits() const {
  std::array<uint8_t, kBits> out{};
  for (int i = 0; i < kFingerprintBits; ++i) out[i] = (fingerprint >> i) & 1;
  out[kDecoyBit] = decoy;
  out[kHasNextBit] = next.has_value();
  const uint64_t packed = next ? next->pack() : 0;
  for (int i = 0; i < 64; ++i) out[kNextBits + i] = (packed >> i) & 1;
  return out;
}

uint64_t CollectiveAgreement::fingerprint(int64_t kind, int64_t dtype,
                                          const std::vector<int64_t>& ids) {
  uint64_t hash = mix(mix(kFnvOffset, static_cast<uint64_t>(kind)), static_cast<uint64_t>(dtype));
  for (int64_t id : ids) hash = mix(hash, static_cast<uint64_t>(id));
  return hash;
}

uint64_t CollectiveAgreement::context_of(int64_t seq) const {
  uint64_t hash = kFnvOffset;
  for (int64_t s = seq - kContext + 1; s <= seq; ++s) {
    auto it = fingerprints_.find(s);
    hash = mix(hash, it == fingerprints_.end() ? 0 : it->second);
  }
  return hash;
}

bool CollectiveAgreement::settled(int64_t seq) const {
  if (seq < next_seq_ - kLag) return true;
  auto it = settled_.find(seq);
  return it != settled_.end() && it->second;
}

std::optional<int64_t> CollectiveAgreement::unsettled_before_next() const {
  const int64_t before = next_seq_ - kLag;
  if (before < 0 || settled(before)) return std::nullopt;
  return before;
}

CollectiveAgreement::Issue CollectiveAgreement::plan(uint64_t fingerprint, const WireShape& shape,
                                                     int64_t kind, int64_t count, int64_t first,
                                                     bool exchange) {
  SHARC_CHECK(!unsettled_before_next(), "sharc: collective ", next_seq_ - kLag,
              " must be settled before collective ", next_seq_, " is planned");
  Issue issue;
  issue.seq = next_seq_++;
  const int64_t seq = issue.seq;
  fingerprints_[seq] = fingerprint;
  settled_[seq] = false;
  // What this rank learns: the shape that came kLag after the context then.
  if (seq >= kLag) predictions_[context_of(seq - kLag)] = shape;
  auto predicted = predictions_.find(context_of(seq));
  issue.header = {fingerprint,
                  predicted == predictions_.end() ? std::nullopt
                                                  : std::optional<WireShape>(predicted->second),
                  false, kind, count, first};
  // What every rank announced for this one, kLag collectives ago.
  std::optional<WireShape> expected;
  if (auto it = expected_.find(seq); it != expected_.end()) {
    expected = it->second;
    expected_.erase(it);
  }
  issue.wire = shape;
  if (exchange || !expected) {
    issue.plan = Plan::kExchange;
  } else if (*expected == shape) {
    issue.plan = Plan::kDirect;
  } else {
    issue.plan = Plan::kDecoy;
    issue.wire = *expected;
  }
  // Forget what no later plan reads.
  fingerprints_.erase(fingerprints_.begin(), fingerprints_.lower_bound(seq - kLag - kContext));
  settled_.erase(settled_.begin(), settled_.lower_bound(seq - kLag));
  return issue;
}

Verdict CollectiveAgreement::judge(const std::vector<CollectiveHeader>& rows, int64_t rank) {
  Verdict v;
  const CollectiveHeader& mine = rows.at(static_cast<size_t>(rank));
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r].fingerprint != mine.fingerprint || rows[r].decoy != mine.decoy) {
      v.kind = Verdict::kDiverged;
      v.other = static_cast<int64_t>(r);
      v.theirs = rows[r];
      return v;
    }
  }
  v.common = mine;
  for (const CollectiveHeader& row : rows) {
    if (row.next != mine.next) v.common.next.reset();
  }
  v.kind = mine.decoy ? Verdict::kRedo : Verdict::kAgree;
  return v;
}

Verdict CollectiveAgreement::judge_bits(const std::vector<int64_t>& sums, int64_t world) {
  SHARC_CHECK(sums.size() == static_cast<size_t>(CollectiveHeader::kBits),
              "sharc: a collective header has ", CollectiveHeader::kBits, " bits, got ",
              sums.size());
  auto alike = [&](int from, int to) {
    for (int i = from; i < to; ++i) {
      if (sums[i] != 0 && sums[i] != world) return false;
    }
    return true;
  };
  Verdict v;
  if (!alike(0, kHasNextBit)) {  // fingerprint or decoy flag
    v.kind = Verdict::kDiverged;
    return v;
  }
  auto bit = [&](int i) { return static_cast<uint64_t>(sums[i] == world ? 1 : 0); };
  for (int i = 0; i < kFingerprintBits; ++i) v.common.fingerprint |= bit(i) << i;
  v.common.decoy = bit(kDecoyBit) != 0;
  if (alike(kHasNextBit, CollectiveHeader::kBits) && bit(kHasNextBit)) {
    uint64_t packed = 0;
    for (int i = 0; i < 64; ++i) packed |= bit(kNextBits + i) << i;
    v.common.next = WireShape::unpack(packed);
  }
  v.kind = v.common.decoy ? Verdict::kRedo : Verdict::kAgree;
  return v;
}

Verdict CollectiveAgreement::settle(int64_t seq, const std::vector<CollectiveHeader>& rows,
                                    int64_t rank) {
  return settled(seq) ? Verdict{} : record(seq, judge(rows, rank));
}

Verdict CollectiveAgreement::settle_bits(int64_t seq, const std::vector<int64_t>& sums,
                                         int64_t world) {
  return settled(seq) ? Verdict{} : record(seq, judge_bits(sums, world));
}

Verdict CollectiveAgreement::record(int64_t seq, const Verdict& verdict) {
  settled_[seq] = true;
  if (verdict.kind == Verdict::kAgree) expected_[seq + kLag] = verdict.common.next;
  return verdict;
}

}  // namespace sharc
