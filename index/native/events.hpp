// KV-event batches in native code: msgpack EventBatch -> events -> the router's own
// rolling hashes -> the index, with the engine hash -> router hash map per worker.
//
// Decoding follows index/codec.py rule for rule (array- or map-encoded events and
// batches, signed / unsigned / bytes hashes, unknown fields ignored, a bad event counted
// and skipped, an unreadable envelope rejected whole). What the native path does not
// hash itself — LoRA roots, extra keys, cache salts, EAGLE token pairs — marks the batch
// ``slow``: Python decodes it with index/codec.py and hands the prepared events back
// (index/hashing.py keeps those semantics in one place).
//
// A bytes engine hash (vLLM's default, a 32-byte sha256) is keyed by 64 bits of its own
// (``bytes_key``) like an int hash is by its value, and the rest of its bytes are kept
// beside the worker's block (WorkerBlocks) so that prefetch hints name it as the engine
// does. Until session 10 these batches went to Python's decoder: every batch of a
// default vLLM.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "flat_map.hpp"
#include "keyed.hpp"
#include "msgpack_reader.hpp"
#include "node_table.hpp"
#include "prefix_index.hpp"
#include "xxh3.hpp"

namespace cr {

enum EventKind : uint8_t { STORED = 0, REMOVED = 1, CLEARED = 2 };

// Seeds the 64-bit key of a bytes engine hash, so it does not equal the int hash with
// the same value by construction.
constexpr uint64_t BYTES_KEY_SEED = 0x62797465735F6B79ULL;
// A 32-byte hash's key is its first 8 bytes xor the XXH3-64 of the other 24: a bijection
// for a given tail, so the key and the tail give the hash back (``WorkerBlocks`` keeps
// 24 bytes a block, not 32), and it depends on every byte (a hash with a constant head,
// or a constant tail, still spreads). Other lengths: the XXH3-64 of all the bytes.
// Not collision-resistant against a publisher that crafts names for a chosen key (nor
// was XXH3 under a public seed): keys live in one worker's own map, so all such names
// can confuse is the blocks of the worker whose events that publisher already writes.
constexpr size_t DIGEST = 32, HEAD = 8, TAIL = DIGEST - HEAD;

inline uint64_t tail_mix(const char* tail) { return xxh3_64(tail, TAIL, BYTES_KEY_SEED); }

inline uint64_t bytes_key(std::string_view b) {
    if (b.size() != DIGEST) return xxh3_64(b.data(), b.size(), BYTES_KEY_SEED);
    uint64_t head;
    std::memcpy(&head, b.data(), HEAD);
    return head ^ tail_mix(b.data() + HEAD);
}

struct PEvent {
    uint8_t kind = STORED;
    int tier = GPU;  // -1: unknown medium
    bool other_group = false;
    bool has_parent = false;
    bool has_root = false;
    bool bad_tokens = false;  // token ids that are no u32s (the Python-prepared path)
    uint64_t parent = 0;
    uint64_t root = 0;
    int64_t block_size = 0;
    std::vector<uint64_t> hashes;
    // (position in ``hashes``, the engine's bytes) of each bytes hash: views into the
    // payload or the prepared event's bytes objects, alive until the event is applied
    std::vector<std::pair<uint32_t, std::string_view>> wide;
    std::vector<uint32_t> tokens;
    std::vector<std::pair<int64_t, std::string>> extras;  // block index -> extra bytes
};

struct ParsedBatch {
    double ts = 0;
    bool has_dp = false;
    int64_t dp = 0;
    bool slow = false;
    int64_t bad_event = 0, unknown_event = 0;
    std::vector<PEvent> events;
};

// Rolling hashes of every full block; ``window`` is block_size (+1 for bigram blocks).
inline void rolling_hashes(const uint32_t* tokens, size_t n_tokens, size_t block_size,
                           bool bigram, uint64_t h, std::vector<uint64_t>& out) {
    const size_t n = bigram ? (n_tokens ? (n_tokens - 1) / block_size : 0) : n_tokens / block_size;
    const size_t window = (block_size + (bigram ? 1 : 0)) * 4;
    const auto* bytes = reinterpret_cast<const uint8_t*>(tokens);
    out.resize(n);
    for (size_t i = 0; i < n; ++i) {
        h = xxh3_64(bytes + i * block_size * 4, window, h);
        out[i] = h;
    }
}

using TierTable = std::unordered_map<std::string, int>;

// One parse: the payload as a flat preorder array of nodes, then read as a batch.
class BatchParser {
   public:
    explicit BatchParser(const TierTable& tiers) : tiers_(tiers), nodes_(nodes_tls()), ints_(ints_tls()) {
        nodes_.clear();
        ints_.clear();
    }
    // The per-thread scratch is kept for the next parse up to a bound, and given back
    // past it: a 1 MB batch of tiny values grew it by ~49 MB, kept until the thread ended.
    ~BatchParser() {
        if (nodes_.capacity() > KEEP_NODES) std::vector<Node>().swap(nodes_);
        if (ints_.capacity() > KEEP_INTS) std::vector<uint64_t>().swap(ints_);
    }
    BatchParser(const BatchParser&) = delete;
    BatchParser& operator=(const BatchParser&) = delete;

    // Throws DecodeError when the payload is not an EventBatch at all.
    void parse(const uint8_t* p, size_t n, ParsedBatch& out) {
        nodes_.reserve(64);
        ints_.reserve(n / 2 + 4);
        Reader r(p, n);
        build(r, 0);
        if (!r.done()) throw DecodeError("extra bytes after the batch");
        out = ParsedBatch{};
        envelope(out);
    }

   private:
    static constexpr size_t KEEP_NODES = 16384, KEEP_INTS = 65536;  // ~640 KB + 512 KB

    struct Node {
        Value v;
        uint32_t size;    // nodes in this subtree, itself included
        int32_t packed;   // an array of unsigned ints only: its values start at ints_[packed]
    };

    // msgpack-python's (index/codec.py's) limits, so both decoders refuse the same
    // payloads: 1,024 nested containers at most, and no array or map as a map key (a
    // Python dict key must be hashable).
    static constexpr int MAX_DEPTH = 1024;

    void build(Reader& r, int depth) {
        const size_t at = nodes_.size();
        nodes_.push_back(Node{r.next(), 1, -1});
        const Value v = nodes_[at].v;
        if (v.kind == Kind::Str && !utf8_ok(v.bytes)) throw DecodeError("invalid utf-8");
        if (v.kind != Kind::Array && v.kind != Kind::Map) return;
        if (depth >= MAX_DEPTH) throw DecodeError("nested too deep");
        if (v.kind == Kind::Array && pack(r, v.n)) {
            nodes_[at].packed = static_cast<int32_t>(ints_.size() - v.n);
            return;
        }
        if (v.kind == Kind::Array) {
            for (uint32_t i = 0; i < v.n; ++i) build(r, depth + 1);
        } else {
            for (uint32_t i = 0; i < v.n; ++i) {
                const size_t key = nodes_.size();
                build(r, depth + 1);
                const Kind k = nodes_[key].v.kind;
                if (k == Kind::Array || k == Kind::Map) throw DecodeError("unhashable map key");
                build(r, depth + 1);
            }
        }
        nodes_[at].size = static_cast<uint32_t>(nodes_.size() - at);
    }

    // Token ids and hashes are arrays of unsigned ints: keep them as plain numbers, not
    // one node each (4x faster decoding of a 1K-token event).
    bool pack(Reader& r, uint32_t n) {
        const uint8_t* start = r.pos();
        const size_t mark = ints_.size();
        ints_.resize(mark + n);
        if (r.uints(ints_.data() + mark, n) == n) return true;
        r.seek(start);
        ints_.resize(mark);
        return false;
    }

    static bool utf8_ok(std::string_view s) {
        const auto* p = reinterpret_cast<const uint8_t*>(s.data());
        const auto* e = p + s.size();
        while (p < e) {
            uint8_t c = *p;
            if (c < 0x80) {
                ++p;
                continue;
            }
            int n;
            uint32_t cp;
            if ((c & 0xe0) == 0xc0) n = 1, cp = c & 0x1f;
            else if ((c & 0xf0) == 0xe0) n = 2, cp = c & 0x0f;
            else if ((c & 0xf8) == 0xf0) n = 3, cp = c & 0x07;
            else return false;
            if (e - p <= n) return false;
            for (int i = 1; i <= n; ++i) {
                if ((p[i] & 0xc0) != 0x80) return false;
                cp = (cp << 6) | (p[i] & 0x3f);
            }
            if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
                cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
                return false;
            p += n + 1;
        }
        return true;
    }

    // Children of the container at ``i``.
    std::vector<size_t> children(size_t i) const {
        std::vector<size_t> out;
        children(i, out);
        return out;
    }
    void children(size_t i, std::vector<size_t>& out) const {
        out.clear();
        const Node& c = nodes_[i];
        if (c.packed >= 0) return;
        size_t count = c.v.kind == Kind::Array ? c.v.n : 2ULL * c.v.n;
        out.reserve(count);  // the nodes exist (build parsed them): one allocation, not ~5
        size_t j = i + 1;
        for (size_t k = 0; k < count; ++k) {
            out.push_back(j);
            j += nodes_[j].size;
        }
    }

    bool is_str(size_t i, std::string_view s) const {
        return nodes_[i].v.kind == Kind::Str && nodes_[i].v.bytes == s;
    }

    // Value node of ``key`` in the map at ``i`` (the last one wins, as in a Python
    // dict), or 0 when absent.
    size_t field(const std::vector<size_t>& kv, std::string_view key) const {
        size_t found = 0;
        for (size_t k = 0; k + 1 < kv.size(); k += 2)
            if (is_str(kv[k], key)) found = kv[k + 1];
        return found;
    }

    Kind kind(size_t i) const { return i ? nodes_[i].v.kind : Kind::Nil; }

    void envelope(ParsedBatch& out) {
        const Node& top = nodes_[0];
        size_t ts = 0, events = 0, dp = 0;
        if (top.v.kind == Kind::Array && top.v.n >= 2) {
            if (top.packed >= 0) throw DecodeError("EventBatch.events is not a list");
            auto c = children(0);
            ts = c[0], events = c[1];
            dp = c.size() > 2 ? c[2] : 0;
        } else if (top.v.kind == Kind::Map) {
            auto kv = children(0);
            events = field(kv, "events");
            bool has_events = false;
            for (size_t k = 0; k + 1 < kv.size(); k += 2) has_events |= is_str(kv[k], "events");
            if (!has_events) throw DecodeError("not an EventBatch");
            ts = field(kv, "ts");
            for (const char* name : {"data_parallel_rank", "dp_rank", "attn_dp_rank"}) {
                size_t d = field(kv, name);
                if (kind(d) != Kind::Nil) {
                    dp = d;
                    break;
                }
            }
        } else {
            throw DecodeError("not an EventBatch");
        }
        if (kind(events) != Kind::Array) throw DecodeError("EventBatch.events is not a list");
        switch (kind(ts)) {
            case Kind::Nil:
                if (ts) throw DecodeError("EventBatch.ts is not a number");
                out.ts = 0;  // a map without "ts"
                break;
            case Kind::UInt: out.ts = static_cast<double>(nodes_[ts].v.u); break;
            case Kind::Int: out.ts = static_cast<double>(nodes_[ts].v.i); break;
            case Kind::Float: out.ts = nodes_[ts].v.f; break;
            default: throw DecodeError("EventBatch.ts is not a number");
        }
        switch (kind(dp)) {
            case Kind::Nil: break;
            case Kind::UInt:
                out.has_dp = true;
                out.dp = static_cast<int64_t>(nodes_[dp].v.u);
                if (nodes_[dp].v.u > static_cast<uint64_t>(INT64_MAX)) out.slow = true;
                break;
            case Kind::Int: out.has_dp = true, out.dp = nodes_[dp].v.i; break;
            default: throw DecodeError("EventBatch dp rank is not an int");
        }
        if (nodes_[events].packed >= 0) out.bad_event += nodes_[events].v.n;  // ints
        for (size_t e : children(events)) {
            PEvent ev;
            switch (event(e, ev, out.slow)) {
                case 0: out.events.push_back(std::move(ev)); break;
                case 1: ++out.bad_event; break;
                default: ++out.unknown_event; break;
            }
        }
    }

    // A bad event is flagged in ``bad_``, never thrown: a C++ exception per bad event
    // cost ~2.6 us, so 1M ``nil`` events in a 1 MB batch held the reader's thread for
    // 2.65 s (a benign batch of that size: 6 ms). The helpers below set it and return a
    // neutral value; ``event`` checks it after each.
    bool fail() const {
        bad_ = true;
        return false;
    }

    // An engine hash's key; a bytes hash's bytes into ``bin`` (when given).
    uint64_t hash(size_t i, std::string_view* bin) const {
        if (!i) return fail();
        const Value& v = nodes_[i].v;
        if (v.kind == Kind::UInt) return v.u;
        if (v.kind == Kind::Int) return static_cast<uint64_t>(v.i);
        if (v.kind == Kind::Bin) {
            if (bin) *bin = v.bytes;
            return bytes_key(v.bytes);
        }
        return fail();
    }

    void hashes(size_t i, PEvent& ev) const {
        if (kind(i) != Kind::Array) {
            fail();
            return;
        }
        if (nodes_[i].packed >= 0) {
            const uint64_t* p = ints_.data() + nodes_[i].packed;
            ev.hashes.assign(p, p + nodes_[i].v.n);
            return;
        }
        const std::vector<size_t> kids = children(i);
        ev.hashes.reserve(kids.size());
        if (!kids.empty() && nodes_[kids[0]].v.kind == Kind::Bin) ev.wide.reserve(kids.size());
        for (size_t c : kids) {
            std::string_view bin;
            ev.hashes.push_back(hash(c, &bin));
            if (bad_) return;
            if (nodes_[c].v.kind == Kind::Bin)
                ev.wide.emplace_back(static_cast<uint32_t>(ev.hashes.size() - 1), bin);
        }
    }

    // None, or the int's value (nonzero-ness is all the callers need).
    bool opt_int_nonzero(size_t i) const {
        switch (kind(i)) {
            case Kind::Nil: return false;
            case Kind::UInt: return nodes_[i].v.u != 0;
            case Kind::Int: return true;
            default: return fail();
        }
    }

    // True when present; ``out`` gets the text.
    bool opt_str(size_t i, std::string_view& out) const {
        switch (kind(i)) {
            case Kind::Nil: return false;
            case Kind::Str: out = nodes_[i].v.bytes; return true;
            case Kind::Bin:
                if (!utf8_ok(nodes_[i].v.bytes)) return fail();
                out = nodes_[i].v.bytes;
                return true;
            default: return fail();
        }
    }

    static std::string upper(std::string_view s) {
        std::string up(s);
        for (char& c : up)
            if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
        return up;
    }

    int lookup(const std::string& medium) const {
        auto it = tiers_.find(medium);
        return it == tiers_.end() ? -1 : it->second;
    }

    // vLLM 0.33's ``locality: "REMOTE"`` is the REMOTE medium whatever device it names
    // (index/codec.py ``_medium``); otherwise the medium, GPU when absent.
    int tier_of(size_t medium_node, size_t locality_node) const {
        std::string_view text;
        if (opt_str(locality_node, text) && upper(text) == "REMOTE") return lookup("REMOTE");
        if (!opt_str(medium_node, text)) return GPU;
        return lookup(upper(text));
    }

    // 0: decoded, 1: bad event, 2: unknown kind.
    int event(size_t e, PEvent& ev, bool& slow) {
        bad_ = false;
        bool s = false;
        const int r = event_or_bad(e, ev, s);
        if (bad_) return 1;
        slow |= s;  // as before: a bad event's earlier fields may send the batch to Python
        return r;
    }

    // ``bad_`` set: a bad event (whatever it returns).
    int event_or_bad(size_t e, PEvent& ev, bool& slow) {
        std::vector<size_t>& body = body_;
        bool as_map = false;
        std::string_view tag;
        if (kind(e) == Kind::Array && nodes_[e].packed < 0 && nodes_[e].v.n &&
            (kind(e + 1) == Kind::Str || kind(e + 1) == Kind::Bin)) {
            children(e, body);
            body.erase(body.begin());
            if (!opt_str(e + 1, tag)) return fail();
        } else if (kind(e) == Kind::Map) {
            as_map = true;
            children(e, body);
            size_t t = field(body, "type");
            if (kind(t) != Kind::Str && kind(t) != Kind::Bin) return fail();
            if (!opt_str(t, tag)) return fail();
        } else {
            return fail();
        }
        static constexpr std::array<std::string_view, 11> stored_fields = {
            "block_hashes", "parent_block_hash", "token_ids",          "block_size",
            "lora_id",      "medium",            "lora_name",          "extra_keys",
            "group_idx",    "kv_cache_spec_kind", "kv_cache_spec_sliding_window"};
        static constexpr std::array<std::string_view, 3> removed_fields = {
            "block_hashes", "medium", "group_idx"};
        auto get = [&](auto& names, size_t pos) -> size_t {
            if (as_map) return field(body, names[pos]);
            return pos < body.size() ? body[pos] : 0;
        };
        if (tag == "BlockStored") {
            ev.kind = STORED;
            size_t bs = get(stored_fields, 3);
            if (kind(bs) != Kind::UInt || nodes_[bs].v.u == 0) return fail();
            ev.block_size = nodes_[bs].v.u > (1ULL << 40) ? -1 : static_cast<int64_t>(nodes_[bs].v.u);
            hashes(get(stored_fields, 0), ev);
            if (bad_) return 1;
            size_t parent = get(stored_fields, 1);
            if (kind(parent) != Kind::Nil) {
                ev.has_parent = true;
                ev.parent = hash(parent, nullptr);
                if (bad_) return 1;
            }
            size_t toks = get(stored_fields, 2);
            if (kind(toks) != Kind::Array) return fail();
            if (nodes_[toks].packed >= 0) {
                const uint64_t* p = ints_.data() + nodes_[toks].packed;
                const uint32_t n = nodes_[toks].v.n;
                ev.tokens.resize(n);
                uint64_t high = 0;
                for (uint32_t k = 0; k < n; ++k) {
                    high |= p[k];
                    ev.tokens[k] = static_cast<uint32_t>(p[k]);
                }
                if (high > 0xFFFFFFFFULL) return fail();
            }
            children(toks, kids_);
            ev.tokens.reserve(kids_.size());
            for (size_t t : kids_) {
                Kind k = kind(t);
                if (k == Kind::Array) {
                    slow = true;  // EAGLE token pairs
                    continue;
                }
                if (k != Kind::UInt || nodes_[t].v.u > 0xFFFFFFFFULL) return fail();
                ev.tokens.push_back(static_cast<uint32_t>(nodes_[t].v.u));
            }
            if (kind(get(stored_fields, 4)) != Kind::Nil) {
                opt_int_nonzero(get(stored_fields, 4));  // validated
                slow = true;  // an adapter by number: its root is index.hashing's
            }
            ev.tier = tier_of(get(stored_fields, 5), as_map ? field(body, "locality") : 0);
            std::string_view s;
            if (opt_str(get(stored_fields, 6), s)) slow = true;  // lora_name
            size_t extra = get(stored_fields, 7);
            // vLLM sends one entry per block, None for a block with no keys (0.32 does
            // for every block of a plain prompt): only a block's non-empty keys need Python
            // (index.hashing.event_extras skips the rest the same way).
            if (kind(extra) == Kind::Array && nodes_[extra].v.n)
                for (size_t k : children(extra))
                    if (kind(k) == Kind::Array && nodes_[k].v.n) slow = true;
            ev.other_group = opt_int_nonzero(get(stored_fields, 8));
            // A group that is not full attention (a sliding window's sparse stores) is
            // Python's: it learns the pool's groups from them (NativeEventIngest).
            const size_t spec = get(stored_fields, 9);
            if (kind(spec) != Kind::Nil && !is_str(spec, "full_attention")) slow = true;
            if (kind(get(stored_fields, 10)) != Kind::Nil) slow = true;
            if (as_map && opt_str(field(body, "cache_salt"), s)) slow = true;
            return 0;
        }
        if (tag == "BlockRemoved") {
            ev.kind = REMOVED;
            hashes(get(removed_fields, 0), ev);
            ev.tier = tier_of(get(removed_fields, 1), as_map ? field(body, "locality") : 0);
            ev.other_group = opt_int_nonzero(get(removed_fields, 2));
            return 0;
        }
        if (tag == "AllBlocksCleared") {
            ev.kind = CLEARED;
            return 0;
        }
        return 2;
    }

    // Scratch kept per thread across parses (a parse allocated ~5 KB of it each time).
    static std::vector<Node>& nodes_tls() {
        thread_local std::vector<Node> v;
        return v;
    }
    static std::vector<uint64_t>& ints_tls() {
        thread_local std::vector<uint64_t> v;
        return v;
    }

    const TierTable& tiers_;
    std::vector<Node>& nodes_;
    std::vector<uint64_t>& ints_;
    mutable bool bad_ = false;         // the event being read is bad (``fail``)
    std::vector<size_t> body_, kids_;  // an event's fields, its token nodes
};

class EventDecoder {
   public:
    explicit EventDecoder(TierTable tiers) : tiers_(std::move(tiers)) {}
    void set_tiers(TierTable tiers) { tiers_ = std::move(tiers); }

    // Thread-safe (parse runs without the GIL, on any thread): all state is per call.
    void parse(const uint8_t* p, size_t n, ParsedBatch& out) const {
        BatchParser(tiers_).parse(p, n, out);
    }

   private:
    TierTable tiers_;
};

// One block a worker holds, by its engine hash (``key``). Packed: 17 B.
struct __attribute__((packed)) EngineBlock {
    uint64_t key;     // engine hash
    uint64_t router;  // (last) router hash
    uint8_t tiers;    // bit per tier the worker holds the block in
};

// A worker's engine hash -> router hash map and its inverse (router -> engine hash, for
// prefetch hints), as index/ingest.py's ``blocks`` and ``engine_of`` dicts behave.
//
// One 17 B record per block in a NodeTable and the inverse as a second IdIndex over the
// same records: ~29 B a (block, worker) pair, where two FlatMaps (a 17 B and a 16 B slot
// at a load of ~0.79) took ~42 B (bench/scale.py memory, 1M and 5M pairs).
//
// A block the engine named by a 32-byte hash (vLLM's sha256) keeps the 24 bytes its key
// does not give back (``bytes_key``) at its record's id, in chunks made on first use: 24 B
// and a bit a pair, where the whole 32 bytes read 103 B a pair against Dynamo's 89
// (bench/scale.py memory, 1M unshared pairs; a FlatMap of digests paid ~62 B at its
// mean load). Other lengths, which no engine sends by default, go to a node map.
//
// Only prefetch hints read these bytes back. A router whose policies send none keeps
// none (``set_keep_names(false)``): a block named by bytes keeps its bit, so a hint asked
// for anyway stops there (``Name::DROPPED``) and never names it by the wrong hash.
enum class Name : uint8_t { INT, BYTES, DROPPED };

class WorkerBlocks {
   public:
    // Whether bytes names are kept; changed only while the worker holds nothing (a block
    // stored without its name must never read one back: EventApplier checks).
    bool keeps_names() const { return keep_; }
    void set_keep_names(bool keep) { keep_ = keep; }

    size_t size() const { return blocks_.size(); }
    EngineBlock* find(uint64_t engine) { return blocks_.get(engine); }

    // ``engine`` names router block ``router`` (in tier bit ``tbit`` too); it becomes
    // ``router``'s engine hash. ``named``: the engine's own bytes for ``engine``, if any.
    void store(uint64_t engine, uint64_t router, uint8_t tbit, const std::string_view* named) {
        bool inserted;
        const uint32_t id = blocks_.insert(engine, inserted);
        EngineBlock& b = blocks_.at(id);
        if (!inserted && b.router != router &&
            by_router_.find(b.router, router_of()) == id) {
            // The old router hash keeps naming this engine hash (a dict entry nobody
            // overwrote); the index stays keyed by each record's current router hash.
            by_router_.erase(b.router, router_of());
            bool fresh;
            stale_.get_or_insert(b.router, fresh) = engine;
        }
        b.router = router;
        b.tiers |= tbit;
        stale_.erase(router);
        by_router_.put(router, id, router_of());
        if (named) name(id, engine, *named);
    }

    // Drops tier bit ``tbit``; the block is forgotten when no tier is left.
    void unstore(EngineBlock& b, uint8_t tbit) {
        b.tiers &= static_cast<uint8_t>(~tbit);
        if (b.tiers) return;
        const uint64_t router = b.router, engine = b.key;
        by_router_.erase(router, router_of());
        stale_.erase(router);
        if (!spans_.empty()) {
            auto it = spans_.find(engine);
            if (it != spans_.end()) {
                span_blocks_ -= it->second.size();
                spans_.erase(it);
            }
        }
        const uint32_t id = blocks_.find(engine);
        if (bytes_bit(id)) named_[id >> 6] &= ~(uint64_t{1} << (id & 63));
        if (!odd_.empty()) odd_.erase(engine);
        blocks_.erase(id);
    }

    // How the engine named block ``engine``: by an int (the key itself), by bytes (into
    // ``out``), or by bytes this worker did not keep.
    Name engine_name(uint64_t engine, std::string& out) const {
        const uint32_t id = blocks_.find(engine);
        if (id == NodeTable<EngineBlock>::NONE || !bytes_bit(id)) return Name::INT;
        if (!keep_) return Name::DROPPED;
        if (!odd_.empty()) {
            auto it = odd_.find(engine);
            if (it != odd_.end()) {
                out = it->second;
                return Name::BYTES;
            }
        }
        const char* tail = reinterpret_cast<const char*>(digest(id));
        const uint64_t head = engine ^ tail_mix(tail);
        out.resize(DIGEST);
        std::memcpy(out.data(), &head, HEAD);
        std::memcpy(out.data() + HEAD, tail, TAIL);
        return Name::BYTES;
    }

    // ``router``'s engine hash into ``out``; false when there is none.
    bool engine_of(uint64_t router, uint64_t& out) {
        const uint32_t id = by_router_.find(router, router_of());
        if (id != IdIndex::NONE) {
            out = blocks_.at(id).key;
            return true;
        }
        const uint64_t* stale = stale_.find(router);
        if (stale) out = *stale;
        return stale != nullptr;
    }

    template <class F>
    void for_each(F&& f) {
        blocks_.for_each([&](uint32_t, EngineBlock& b) { f(b.key, b.router); });
    }

    void clear() {
        blocks_.clear();
        by_router_.clear();
        stale_.clear();
        spans_.clear();
        span_blocks_ = 0;
        digests_.clear();
        std::vector<uint64_t>().swap(named_);
        odd_.clear();
    }

    size_t bytes() const {
        size_t n = blocks_.bytes() + by_router_.bytes() + stale_.bytes() +
                   digests_.size() * (size_t{1} << CHUNK_BITS) * TAIL + named_.capacity() * 8;
        for (const auto& kv : odd_) n += 48 + kv.second.capacity();  // a node, roughly
        return n;
    }

    // A block k times the router's (a coarser KV group) is k router blocks: the ones
    // before its last, by engine hash. Rare, so not in EngineBlock.
    const std::vector<uint64_t>* span(uint64_t engine) const {
        if (spans_.empty()) return nullptr;
        auto it = spans_.find(engine);
        return it == spans_.end() ? nullptr : &it->second;
    }
    void set_span(uint64_t engine, const uint64_t* routers, size_t n) {
        std::vector<uint64_t>& s = spans_[engine];
        span_blocks_ += n - s.size();
        s.assign(routers, routers + n);
    }

    // Router blocks held (the quota's measure): a block and its span's others.
    size_t router_blocks() const { return blocks_.size() + span_blocks_; }

   private:
    static constexpr int CHUNK_BITS = 14;  // 16K tails (384 KB) a chunk

    struct RouterOf {
        const NodeTable<EngineBlock>* blocks;
        uint64_t operator()(uint32_t id) const { return blocks->at(id).router; }
    };
    RouterOf router_of() const { return RouterOf{&blocks_}; }

    bool bytes_bit(uint32_t id) const {
        return (id >> 6) < named_.size() && (named_[id >> 6] >> (id & 63)) & 1;
    }
    uint8_t* digest(uint32_t id) const {
        return digests_[id >> CHUNK_BITS].get() + (id & ((1u << CHUNK_BITS) - 1)) * TAIL;
    }

    // The bit goes up last: an allocation that throws must not leave a block marked
    // with no tail to read back.
    void name(uint32_t id, uint64_t engine, std::string_view b) {
        if (named_.size() <= (id >> 6)) named_.resize((id >> 6) + 1, 0);
        if (keep_ && b.size() != DIGEST) {
            odd_[engine].assign(b);
        } else if (keep_) {
            const size_t chunk = id >> CHUNK_BITS;
            if (digests_.size() <= chunk) digests_.resize(chunk + 1);
            if (!digests_[chunk]) digests_[chunk].reset(new uint8_t[TAIL << CHUNK_BITS]);
            std::memcpy(digest(id), b.data() + HEAD, TAIL);
        }
        named_[id >> 6] |= uint64_t{1} << (id & 63);
    }

    NodeTable<EngineBlock> blocks_;
    IdIndex by_router_;
    FlatMap<uint64_t> stale_;  // router hashes still naming an engine hash re-stored since
    std::vector<std::unique_ptr<uint8_t[]>> digests_;  // tails by record id, chunks made on use
    std::vector<uint64_t> named_;                      // bit per record id: named by bytes
    std::unordered_map<uint64_t, std::string, KeyedHash> odd_;    // bytes hashes of other lengths
    std::unordered_map<uint64_t, std::vector<uint64_t>, KeyedHash> spans_;  // span
    size_t span_blocks_ = 0;  // router blocks in spans_
    bool keep_ = true;
};

// Error names match index/ingest.py's.
struct ApplyResult {
    int64_t applied = 0;
    std::unordered_map<std::string, int64_t> errors;
    int64_t quota_cuts = 0;  // stores cut short by the worker's quota (ingest.py counts them)
};

class EventApplier {
   public:
    EventApplier(PrefixCore& index, int64_t block_size, bool bigram, uint64_t seed)
        : index_(index), block_size_(block_size), bigram_(bigram), seed_(seed) {}

    void configure(int64_t block_size, bool bigram, uint64_t seed) {
        block_size_ = block_size, bigram_ = bigram, seed_ = seed;
    }

    WorkerBlocks& worker(int slot) { return workers_[slot]; }

    void set_keep_names(bool keep) {
        for (const auto& w : workers_)
            if (w.keeps_names() != keep && w.size())
                throw std::logic_error("whether names are kept is set before any block is");
        for (auto& w : workers_) w.set_keep_names(keep);
    }

    // ``quota``: the most blocks the worker may hold (< 0: no bound).
    void apply(int slot, const std::vector<PEvent>& events, int64_t quota, ApplyResult& res) {
        quota_ = quota;
        res_ = &res;
        for (const PEvent& ev : events) {
            const char* err = one(slot, ev);
            if (err)
                ++res.errors[err];
            else
                ++res.applied;
        }
    }

    size_t bytes() const {
        size_t n = 0;
        for (const auto& w : workers_) n += w.bytes();
        return n;
    }

   private:
    const char* one(int slot, const PEvent& ev) {
        WorkerBlocks& w = workers_[slot];
        if (ev.kind == CLEARED) {
            w.clear();
            index_.clear(slot);
            return nullptr;
        }
        if (ev.other_group) return "other_kv_group";
        if (ev.tier < 0) return "unknown_medium";
        const uint64_t tbit = uint64_t{1} << ev.tier;
        if (ev.kind == REMOVED) {
            gone_.clear();
            for (uint64_t eh : ev.hashes) {
                EngineBlock* ref = w.find(eh);
                if (!ref || !(ref->tiers & tbit)) continue;
                gone_.push_back(uint64_t{ref->router});  // a copy: no reference into a packed record
                if (const std::vector<uint64_t>* span = w.span(eh))
                    gone_.insert(gone_.end(), span->begin(), span->end());
                w.unstore(*ref, static_cast<uint8_t>(tbit));
            }
            index_.remove(slot, gone_.data(), gone_.size(), ev.tier);
            return nullptr;
        }
        if (ev.block_size <= 0 || ev.block_size % block_size_) return "block_size_mismatch";
        const size_t k = static_cast<size_t>(ev.block_size / block_size_);
        size_t n = ev.hashes.size();
        if (n == 0 || ev.tokens.size() != n * ev.block_size + (bigram_ ? 1 : 0))
            return "token_count_mismatch";
        bool has_parent = false;
        uint64_t h = ev.has_root ? ev.root : seed_;
        if (ev.has_parent) {
            const EngineBlock* p = w.find(ev.parent);
            if (!p) return "unknown_parent";
            has_parent = true;
            h = p->router;
        }
        const uint64_t parent = h;
        if (ev.bad_tokens) return "bad_event";
        if (ev.extras.empty()) {
            rolling_hashes(ev.tokens.data(), ev.tokens.size(), block_size_, bigram_, h, router_);
        } else {
            hash_with_extras(ev, h);
        }
        // The quota is in router blocks, as the index counts them: a coarse engine block
        // is k of them (counted as one until session 16, so a worker sending coarse
        // blocks held k times its share and evicted everyone else's).
        if (quota_ >= 0 && static_cast<int64_t>(w.router_blocks() + n * k) > quota_) {
            // Keep the leading blocks that fit: a chain's prefix is still a true prefix.
            size_t room = 0, fresh = 0;
            for (uint64_t eh : ev.hashes) {
                fresh += w.find(eh) == nullptr ? k : 0;
                if (static_cast<int64_t>(w.router_blocks() + fresh) > quota_) break;
                ++room;
            }
            if (room < n) {
                ++res_->quota_cuts;
                if (room == 0) return "worker_quota";
                n = room;
                router_.resize(room * k);
            }
        }
        auto named = ev.wide.begin();  // in the order of ``hashes``
        for (size_t i = 0; i < n; ++i) {
            const uint64_t eh = ev.hashes[i];
            const uint64_t last = router_[(i + 1) * k - 1];
            const bool has_bytes = named != ev.wide.end() && named->first == i;
            w.store(eh, last, static_cast<uint8_t>(tbit), has_bytes ? &named->second : nullptr);
            named += has_bytes;
            if (k > 1) w.set_span(eh, router_.data() + i * k, k - 1);
        }
        index_.store(slot, router_.data(), router_.size(), ev.tier, has_parent, parent);
        return nullptr;
    }

    // index.hashing's loop with extras: per router block (a coarse event's n engine
    // blocks are n * k router blocks), ``extras`` keyed by router block index.
    void hash_with_extras(const PEvent& ev, uint64_t h) {
        const size_t nt = ev.tokens.size();
        const size_t n = bigram_ ? (nt ? (nt - 1) / block_size_ : 0) : nt / block_size_;
        const size_t step = block_size_ * 4, window = step + (bigram_ ? 4 : 0);
        const auto* bytes = reinterpret_cast<const uint8_t*>(ev.tokens.data());
        router_.resize(n);
        for (size_t i = 0; i < n; ++i) {
            const std::string* extra = nullptr;
            for (const auto& [idx, b] : ev.extras)
                if (idx == static_cast<int64_t>(i) && !b.empty()) extra = &b;
            if (extra) {
                buf_.assign(bytes + i * step, bytes + i * step + window);
                buf_.insert(buf_.end(), extra->begin(), extra->end());
                h = xxh3_64(buf_.data(), buf_.size(), h);
            } else {
                h = xxh3_64(bytes + i * step, window, h);
            }
            router_[i] = h;
        }
    }

    PrefixCore& index_;
    int64_t quota_ = -1;
    ApplyResult* res_ = nullptr;
    int64_t block_size_;
    bool bigram_;
    uint64_t seed_;
    WorkerBlocks workers_[MAX_SLOTS];
    std::vector<uint64_t> router_, gone_;
    std::vector<uint8_t> buf_;
};

}  // namespace cr
