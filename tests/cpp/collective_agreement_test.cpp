#include <gtest/gtest.h>

#include "sharc/core/collective_agreement.h"
#include "sharc/core/error.h"

namespace sharc {
namespace {

using Plan = CollectiveAgreement::Plan;
constexpr int64_t kLag = CollectiveAgreement::kLag;

WireShape gather_of(int64_t numel) { return {WireShape::kAllGather, 6, numel}; }

// Two ranks, each planning its own collectives, playing the runtime's part:
// headers exchanged, decoys sent and collectives settled as the plans say.
struct TwoRanks {
  CollectiveAgreement rank[2];
  int64_t collectives = 0;  // on the wire, exchanges and decoys included

  // Rank 0 issues a collective of `a` elements (its fingerprint is `a` too),
  // rank 1 one of `b`: the verdict, once the ranks went through the plans.
  Verdict::Kind issue(int64_t a, int64_t b, Plan* plan = nullptr) {
    auto x = rank[0].plan(static_cast<uint64_t>(a), gather_of(a), 0, 1, a, false);
    auto y = rank[1].plan(static_cast<uint64_t>(b), gather_of(b), 0, 1, b, false);
    EXPECT_EQ(x.wire, y.wire) << "sizes differ on the wire: the backend would abort";
    EXPECT_EQ(x.plan == Plan::kExchange, y.plan == Plan::kExchange);
    if (plan) *plan = x.plan;
    if (x.plan == Plan::kExchange) {
      ++collectives;
      const Verdict v = CollectiveAgreement::judge({x.header, y.header}, 0);
      if (v.kind == Verdict::kDiverged) return v.kind;
    } else if (x.plan == Plan::kDecoy || y.plan == Plan::kDecoy) {
      ++collectives;
      CollectiveHeader dx = x.header, dy = y.header;
      dx.decoy = x.plan == Plan::kDecoy;
      dy.decoy = y.plan == Plan::kDecoy;
      const Verdict v0 = CollectiveAgreement::judge({dx, dy}, 0);
      EXPECT_EQ(v0.kind, CollectiveAgreement::judge({dx, dy}, 1).kind);
      if (v0.kind == Verdict::kDiverged) return v0.kind;
      EXPECT_EQ(v0.kind, Verdict::kRedo);
    }
    ++collectives;
    const std::vector<CollectiveHeader> rows{x.header, y.header};
    const Verdict v0 = rank[0].settle(x.seq, rows, 0);
    EXPECT_EQ(v0.kind, rank[1].settle(y.seq, rows, 1).kind);
    return v0.kind;
  }
  void run(const std::vector<int64_t>& schedule, int steps = 1) {
    for (int s = 0; s < steps; ++s) {
      for (int64_t c : schedule) ASSERT_EQ(issue(c, c), Verdict::kAgree);
    }
  }
};

const std::vector<int64_t> kStep{10, 20, 30, 40, 50, 60};

TEST(WireShape, PacksAndUnpacks) {
  const WireShape s{WireShape::kAllToAll, 15, (int64_t{1} << 40) + 7};
  EXPECT_EQ(WireShape::unpack(s.pack()), s);
  EXPECT_THROW((WireShape{0, 6, int64_t{1} << 54}.pack()), Error);
}

TEST(CollectiveHeader, WordsAndBitsRoundTrip) {
  CollectiveHeader h{0xfeedbeefcafe1234ULL, gather_of(100), true, 1, 3, 17};
  const auto words = h.words();
  const CollectiveHeader back = CollectiveHeader::from_words(words.data());
  EXPECT_EQ(back.fingerprint, h.fingerprint);
  EXPECT_EQ(back.next, h.next);
  EXPECT_TRUE(back.decoy);
  EXPECT_EQ(back.first, 17);
  // Two ranks summing their bits: alike headers come back whole.
  std::vector<int64_t> sums;
  for (uint8_t b : h.bits()) sums.push_back(2 * b);
  const Verdict v = CollectiveAgreement::judge_bits(sums, 2);
  EXPECT_EQ(v.kind, Verdict::kRedo);  // both decoys
  EXPECT_EQ(v.common.fingerprint, h.fingerprint & 0xffffffffULL);
  EXPECT_EQ(v.common.next, h.next);
}

TEST(CollectiveAgreement, TheFirstStepExchangesLaterStepsGoDirect) {
  TwoRanks ranks;
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < kStep.size(); ++i) {
      Plan plan;
      ASSERT_EQ(ranks.issue(kStep[i], kStep[i], &plan), Verdict::kAgree);
      // A collective announces what followed its context (itself and the
      // two before) last time: step 1 announces what step 0 learned.
      EXPECT_EQ(plan, step == 2 ? Plan::kDirect : Plan::kExchange) << step << " " << i;
    }
  }
  EXPECT_EQ(ranks.collectives, 3 * 6 + 2 * 6);
}

TEST(CollectiveAgreement, ASameSizedDivergenceIsFoundInTheCollectiveItself) {
  TwoRanks ranks;
  ranks.run(kStep, 2);
  ASSERT_EQ(ranks.issue(10, 10), Verdict::kAgree);
  Plan plan;
  // Rank 1 skips the collective of 20 and issues 30's: same size on the
  // wire (the fingerprints are the sizes here, so give it 20 elements).
  auto x = ranks.rank[0].plan(20, gather_of(20), 0, 1, 20, false);
  auto y = ranks.rank[1].plan(30, gather_of(20), 0, 1, 30, false);
  plan = x.plan;
  EXPECT_EQ(plan, Plan::kDirect);
  EXPECT_EQ(y.plan, Plan::kDirect);
  const std::vector<CollectiveHeader> rows{x.header, y.header};
  const Verdict v = ranks.rank[0].settle(x.seq, rows, 0);
  EXPECT_EQ(v.kind, Verdict::kDiverged);
  EXPECT_EQ(v.other, 1);
  EXPECT_EQ(v.theirs.first, 30);
  EXPECT_EQ(ranks.rank[1].settle(y.seq, rows, 1).kind, Verdict::kDiverged);
}

TEST(CollectiveAgreement, ADifferentSizedDivergenceSendsADecoyOfTheAnnouncedSize) {
  TwoRanks ranks;
  ranks.run(kStep, 2);
  const int64_t before = ranks.collectives;
  ASSERT_EQ(ranks.issue(10, 10), Verdict::kAgree);
  EXPECT_EQ(ranks.issue(20, 30), Verdict::kDiverged);  // wire sizes checked inside
  EXPECT_EQ(ranks.collectives, before + 2);           // no exchange: the decoy told
}

TEST(CollectiveAgreement, ARankThatStopsEarlyIsFoundAtItsNextCollective) {
  TwoRanks ranks;
  ranks.run(kStep, 2);
  for (size_t i = 0; i + 1 < kStep.size(); ++i) ASSERT_EQ(ranks.issue(kStep[i], kStep[i]), Verdict::kAgree);
  // Rank 1 skips the step's last collective and begins the next step.
  EXPECT_EQ(ranks.issue(60, 10), Verdict::kDiverged);
}

TEST(CollectiveAgreement, AScheduleThatChangesOnEveryRankRedoesAndLearns) {
  TwoRanks ranks;
  ranks.run(kStep, 2);
  const std::vector<int64_t> other{10, 20, 35, 40, 50, 60};
  int64_t before = ranks.collectives;
  ranks.run(other);
  EXPECT_EQ(ranks.collectives, before + 6 + 1);  // one decoy, no exchange
  ranks.run(other, 2);  // contexts met for the first time announce nothing yet
  before = ranks.collectives;
  ranks.run(other);
  EXPECT_EQ(ranks.collectives, before + 6);  // learned: no decoy, no exchange
}

TEST(CollectiveAgreement, PlanningDemandsTheCollectiveKLagBeforeSettled) {
  CollectiveAgreement a;
  for (int64_t i = 0; i < kLag; ++i) a.plan(1, gather_of(1), 0, 1, 0, false);
  ASSERT_EQ(a.unsettled_before_next(), 0);
  EXPECT_THROW(a.plan(1, gather_of(1), 0, 1, 0, false), Error);
}

}  // namespace
}  // namespace sharc
