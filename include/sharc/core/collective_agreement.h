#pragma once
// How the ranks agree on every collective before its result is used.
//
// [Note: collective agreement]
// Every rank must issue the same collectives in the same order. Ranks whose
// code takes different paths (data-dependent routing, a layer skipped on
// one rank, a backward run on some ranks only) would otherwise pair one
// rank's all-gather of a parameter with another rank's all-gather of
// another one, silently mixing parameters where the sizes match, and make
// the backend abort (gloo) or hang (NCCL) where they do not. Checking each
// collective with a small collective of its own would double the latency
// of every collective, so the check rides inside the collectives:
//
// - Each collective carries a header from every rank, in a few elements
//   appended to what the rank sends: a fingerprint of what the rank meant
//   to issue (the kind and the parameters), and the wire shape it expects
//   to issue `kLag` collectives later, as it did the last time it came
//   this way. When the collective completes, every rank holds every rank's
//   header and reaches the same verdict: all fingerprints agree, or every
//   rank raises, naming what the others issued.
// - Sizes must agree before a collective starts. Collective `seq` is
//   issued in the shape every rank announced with collective `seq - kLag`,
//   when they all announced the same one. A rank whose collective is not
//   that sends a decoy of the announced shape instead, carrying its real
//   header, so every rank again meets the same collective and learns the
//   truth from it: all ranks sent alike decoys (the schedule changed on
//   every rank: each now issues its real collective) or they diverged (all
//   raise). Where the ranks announced nothing alike (the first collectives
//   of a run, a path taken for the first time), they exchange their
//   headers in a small collective first.
//
// So a schedule the ranks have run before costs no collective beyond its
// own, whatever its sizes, and sizes never differ on the wire. This class
// holds the bookkeeping and is torch-free; the runtime packs the headers
// into its collectives and settles each collective when it completes.

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace sharc {

/// What a backend must see alike on every rank for a collective to pair up
/// without aborting: the operation, the dtype and the elements each rank
/// sends.
struct WireShape {
  enum Op : int64_t { kAllGather = 0, kAllToAll = 1 };
  int64_t op = kAllGather;
  int64_t dtype = 0;  ///< a c10::ScalarType, as an integer
  int64_t numel = 0;  ///< elements each rank sends

  bool operator==(const WireShape& o) const {
    return op == o.op && dtype == o.dtype && numel == o.numel;
  }
  bool operator!=(const WireShape& o) const { return !(*this == o); }
  /// One word: op in 2 bits, dtype in 8, numel in 54. Throws sharc::Error
  /// for a shape that does not fit.
  uint64_t pack() const;
  static WireShape unpack(uint64_t word);
  std::string to_string() const;
};

/// What one rank says of one collective, carried inside it.
struct CollectiveHeader {
  uint64_t fingerprint = 0;       ///< the collective's kind and parameters
  std::optional<WireShape> next;  ///< the shape expected `kLag` collectives later
  bool decoy = false;             ///< sent in place of a collective unlike the expected one
  int64_t kind = 0;               ///< the runtime's kind of collective (for messages)
  int64_t count = 0;              ///< how many parameters it serves
  int64_t first = -1;             ///< the first one's id

  /// Exact form, for collectives that deliver each rank's bytes (all-gathers).
  static constexpr int kWords = 6;
  std::array<int64_t, kWords> words() const;
  static CollectiveHeader from_words(const int64_t* words);

  /// Form for collectives that sum what the ranks send (reductions): one
  /// element of 0 or 1 per bit (exact in any float dtype for up to 256
  /// ranks): the fingerprint's low 32 bits, the decoy flag, whether `next`
  /// is set and `next` packed. kind/count/first are not carried.
  static constexpr int kBits = 32 + 1 + 1 + 64;
  std::array<uint8_t, kBits> bits() const;
};

/// What every rank concludes from the headers of one collective.
struct Verdict {
  enum Kind { kAgree, kRedo, kDiverged };
  Kind kind = kAgree;
  /// kDiverged, from exact headers: the first rank whose header differs from
  /// this rank's, and that header (else -1).
  int64_t other = -1;
  CollectiveHeader theirs;
  /// kAgree and kRedo: the header every rank sent, `next` set only where
  /// every rank expected the same.
  CollectiveHeader common;
};

class CollectiveAgreement {
 public:
  /// How many collectives ahead a shape is announced: the most a schedule
  /// keeps in flight without waiting, so that settling collective `seq -
  /// kLag` before issuing `seq` rarely waits for anything.
  static constexpr int64_t kLag = 4;

  enum class Plan {
    kDirect,    ///< issue it as it is: every rank expected this shape
    kDecoy,     ///< send a decoy of `wire` first (then redo or raise)
    kExchange,  ///< exchange headers first (nothing alike was expected)
  };
  struct Issue {
    int64_t seq = 0;
    Plan plan = Plan::kExchange;
    WireShape wire;          ///< the shape that goes on the wire (the decoy's)
    CollectiveHeader header;  ///< this rank's header for the real collective
  };

  /// The collective that must be settled before the next one is planned,
  /// if any (settle() or settle_bits() it first).
  std::optional<int64_t> unsettled_before_next() const;

  /// Plans the next collective: `shape` on the wire, `fingerprint` its kind
  /// and parameters. `exchange` forces an exchange of headers first.
  /// Throws sharc::Error if unsettled_before_next() is set.
  Issue plan(uint64_t fingerprint, const WireShape& shape, int64_t kind, int64_t count,
             int64_t first, bool exchange);

  /// Settles collective `seq` from every rank's exact header (rows in rank
  /// order; `rank` is this rank): the verdict, and for kAgree what every
  /// rank expects `kLag` collectives later. Settling twice is a no-op
  /// returning kAgree.
  Verdict settle(int64_t seq, const std::vector<CollectiveHeader>& rows, int64_t rank);
  /// As settle(), from the per-bit sums over `world` ranks of bits().
  Verdict settle_bits(int64_t seq, const std::vector<int64_t>& sums, int64_t world);
  /// Whether collective `seq` was settled (every one kLag before the next
  /// is: plan() demands it).
  bool settled(int64_t seq) const;

  /// Judges headers without settling anything (a decoy's, an exchange's).
  static Verdict judge(const std::vector<CollectiveHeader>& rows, int64_t rank);
  static Verdict judge_bits(const std::vector<int64_t>& sums, int64_t world);

  /// Rolling fingerprint of a collective: FNV-1a over its kind, dtype and
  /// parameter ids, in order. Apart from Python's one fingerprint of what
  /// ranks compare (python/sharc/_fingerprint.py, blake2b over names and
  /// bytes, once per call): this one runs on every collective, on the hot
  /// path, in the torch-free core, over a few integers.
  static uint64_t fingerprint(int64_t kind, int64_t dtype, const std::vector<int64_t>& ids);

 private:
  /// The context a prediction is keyed by: the last kContext fingerprints,
  /// so that one collective met in forward and again in backward (the same
  /// parameters re-gathered) predicts each its own follower.
  static constexpr int64_t kContext = 3;
  uint64_t context_of(int64_t seq) const;
  /// Marks `seq` settled and, where the ranks agreed, what they expect kLag later.
  Verdict record(int64_t seq, const Verdict& verdict);

  int64_t next_seq_ = 0;
  /// The shape every rank announced for a collective (nullopt: not alike),
  /// by its seq, once the collective kLag earlier settled.
  std::map<int64_t, std::optional<WireShape>> expected_;
  std::map<int64_t, bool> settled_;  ///< the recent collectives' settled flags
  std::map<int64_t, uint64_t> fingerprints_;  ///< of the recent collectives, by seq
  std::map<uint64_t, WireShape> predictions_;  ///< context -> shape kLag later
};

}  // namespace sharc
