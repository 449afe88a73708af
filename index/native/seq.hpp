// Sequence tracking per (worker, dp rank) in native code: index/ingest.py's
// ``EventIngest.apply_batch`` rule for rule (that Python stays the reference; the ingest
// tests run against both). Living here, a batch is checked, decoded and applied in one
// call with the GIL released: the Python bookkeeping around each native call held the
// GIL for ~18 us of a 36 us batch (16 blocks), half the ingest cost and the stalls
// matches saw while ingesting.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cr {

// Ranks are small ints from the transport; "no rank" (None) is its own seq space.
constexpr int64_t NO_RANK = INT64_MIN;
constexpr int64_t EPOCH_START_SEQ = -1;

enum SeqStatus : int {
    SEQ_OK = 0,
    SEQ_DUPLICATE = 1,
    SEQ_GAP = 2,
    SEQ_RESTART = 3,
    SEQ_MALFORMED = 4,
    SEQ_JUMP = 5,
    SEQ_REFUSED = 6,
};

// An optional string (the engine life a batch belongs to; None: not told).
struct Epoch {
    bool has = false;
    std::string text;
    bool operator==(const Epoch& o) const { return has == o.has && (!has || text == o.text); }
    bool operator!=(const Epoch& o) const { return !(*this == o); }
};

class RankMap {  // rank -> seq; a worker names a handful of ranks, so a flat vector
   public:
    const int64_t* find(int64_t rank) const {
        for (const auto& [r, s] : v_)
            if (r == rank) return &s;
        return nullptr;
    }
    int64_t* find(int64_t rank) { return const_cast<int64_t*>(std::as_const(*this).find(rank)); }
    void set(int64_t rank, int64_t seq) {
        if (int64_t* s = find(rank))
            *s = seq;
        else
            v_.emplace_back(rank, seq);
    }
    void erase(int64_t rank) {
        v_.erase(std::remove_if(v_.begin(), v_.end(), [&](auto& p) { return p.first == rank; }),
                 v_.end());
    }
    size_t size() const { return v_.size(); }
    void clear() { v_.clear(); }
    const std::vector<std::pair<int64_t, int64_t>>& items() const { return v_; }

   private:
    std::vector<std::pair<int64_t, int64_t>> v_;
};

struct SeqState {
    bool known = false;  // the Python reference's "has a _Worker"
    RankMap last;        // last applied seq per rank
    RankMap seen;        // highest seq seen per rank
    Epoch epoch;
    bool in_sync = true;

    void forget() { *this = SeqState{}; }
    void recompute_sync() {
        in_sync = true;
        for (const auto& [r, s] : seen.items()) {
            const int64_t* l = last.find(r);
            if ((l ? *l : -1) < s) in_sync = false;
        }
    }
};

// What the seq check decided for one batch.
struct SeqDecision {
    int status = SEQ_OK;
    bool has_expected = true;
    int64_t expected = 0;
    bool past_max = false;  // expected is 2**63: after a seq of INT64_MAX (Python's ints go on)

    // Expect the seq after ``seq`` (no signed overflow at INT64_MAX: UBSan, session 16).
    void expect_after(int64_t seq) {
        past_max = seq == INT64_MAX;
        expected = past_max ? seq : seq + 1;
    }
    bool apply = false;       // apply the batch's events, then ``commit``
    bool reset = false;       // the worker's state was cleared first (a restart)
    bool restarted = false;   // count a restart
    const char* self_error = nullptr;  // counted on the ingest, not the batch's result
};

// The rules, without the events: ``decide`` may ask for a reset (the caller clears the
// worker's blocks) and, when the batch is to be applied, ``commit`` runs after it.
class SeqRules {
   public:
    SeqRules(int64_t max_seq_jump, int64_t max_ranks)
        : max_seq_jump_(max_seq_jump), max_ranks_(max_ranks) {}

    void configure(int64_t max_seq_jump, int64_t max_ranks) {
        max_seq_jump_ = max_seq_jump, max_ranks_ = max_ranks;
    }

    SeqDecision decide(SeqState& w, int64_t rank, int64_t seq, const Epoch& epoch) const {
        SeqDecision d;
        if (!w.known) {
            w.known = true;
            w.epoch = epoch;
        }
        if (seq == EPOCH_START_SEQ && epoch.has) return epoch_start(w, rank, epoch);
        const int64_t* last = w.last.find(rank);
        if (!w.seen.find(rank) && !last && static_cast<int64_t>(w.seen.size()) >= max_ranks_) {
            d.status = SEQ_REFUSED;
            d.self_error = "too_many_ranks";
            d.has_expected = last != nullptr;
            return d;
        }
        // Python's ints do not overflow: compare without the subtraction when seq is huge.
        const int64_t base = last ? *last : -1;
        if (seq > base && static_cast<uint64_t>(seq) - static_cast<uint64_t>(base) >
                              static_cast<uint64_t>(max_seq_jump_)) {
            d.status = SEQ_JUMP;
            d.self_error = "seq_jump";
            d.expected = 0;
            w.in_sync = false;
            return d;
        }
        const int64_t* seen = w.seen.find(rank);
        w.seen.set(rank, seen ? std::max(seq, *seen) : seq);
        d.status = SEQ_OK;
        if (epoch.has && w.epoch.has && epoch != w.epoch) {
            restart(w, rank, seq, d);
            w.epoch = epoch;
            if (seq != 0) return gap(w, 0, d);
            d.status = SEQ_RESTART;
        } else if (!last) {
            if (seq != 0) return gap(w, 0, d);
        } else if (seq == 0 && *last > 0 && !epoch.has) {
            restart(w, rank, seq, d);
            d.status = SEQ_RESTART;
        } else if (seq <= *last) {
            d.status = SEQ_DUPLICATE;
            d.expect_after(*last);
            return d;
        } else if (!follows(*last, seq)) {
            gap(w, 0, d);
            d.expect_after(*last);
            return d;
        }
        if (epoch.has) w.epoch = epoch;
        d.expect_after(seq);
        d.apply = true;
        return d;
    }

    // ``seq`` is the one after ``last``.
    static bool follows(int64_t last, int64_t seq) { return last != INT64_MAX && seq == last + 1; }

    static void commit(SeqState& w, int64_t rank, int64_t seq) {
        w.last.set(rank, seq);
        w.recompute_sync();
    }

    // The batch could not be decoded: a damaged copy of one applied already, or missing.
    static SeqDecision malformed(SeqState& w, int64_t rank, int64_t seq, const Epoch& epoch) {
        SeqDecision d;
        w.known = true;
        const int64_t* last = w.last.find(rank);
        if (last && seq <= *last && (!epoch.has || epoch == w.epoch)) {
            d.status = SEQ_DUPLICATE;
            d.expect_after(*last);
            return d;
        }
        w.in_sync = false;
        d.status = SEQ_MALFORMED;
        d.expected = seq;
        return d;
    }

    // A full dump taken at ``seq`` replaces everything (the caller resets first and
    // applies the dump's events after).
    static void load_dump(SeqState& w, int64_t rank, int64_t seq, const Epoch& epoch) {
        w.known = true;
        int64_t high = seq;
        if (!epoch.has || epoch == w.epoch) {
            const int64_t* s = w.seen.find(rank);
            if (s) high = *s;
        }
        w.last.clear();
        w.seen.clear();
        w.epoch = epoch;
        w.last.set(rank, seq);
        w.seen.set(rank, std::max(seq, high));
        w.in_sync = seq >= high;  // newer batches that arrived meanwhile need a replay
    }

    // Ranks seen only in gaps after an answered replay named batches that never existed.
    static void forget_unconfirmed(SeqState& w) {
        std::vector<int64_t> drop;
        for (const auto& [r, s] : w.seen.items())
            if (!w.last.find(r)) drop.push_back(r);
        for (int64_t r : drop) w.seen.erase(r);
        w.recompute_sync();
    }

   private:
    static SeqDecision epoch_start(SeqState& w, int64_t rank, const Epoch& epoch) {
        SeqDecision d;
        const int64_t* last = w.last.find(rank);
        if (epoch == w.epoch && last) {
            d.status = SEQ_DUPLICATE;
            d.expect_after(*last);
            return d;
        }
        d.restarted = w.epoch.has && epoch != w.epoch;
        d.reset = true;
        w.last.clear();
        w.seen.clear();
        w.epoch = epoch;
        w.last.set(rank, EPOCH_START_SEQ);
        w.seen.set(rank, EPOCH_START_SEQ);
        w.in_sync = true;
        d.status = SEQ_RESTART;
        d.expected = 0;
        return d;
    }

    static void restart(SeqState& w, int64_t rank, int64_t seq, SeqDecision& d) {
        d.restarted = true;
        d.reset = true;
        w.last.clear();
        w.seen.clear();
        w.seen.set(rank, seq);
    }

    static SeqDecision gap(SeqState& w, int64_t expected, SeqDecision& d) {
        w.in_sync = false;
        d.status = SEQ_GAP;
        d.expected = expected;
        d.apply = false;
        return d;
    }

    int64_t max_seq_jump_;
    int64_t max_ranks_;
};

}  // namespace cr
