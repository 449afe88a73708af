// Python binding of the native core (index._native). Slot-based and typed at the
// boundary: the Python wrappers (index/native_index.py) own worker names, the clock and
// the result types. Every call that touches the index takes the index's mutex; a call
// that cannot get it at once waits with the GIL released, so the ingest thread (which
// applies a whole batch under the mutex, GIL released) and the request path never
// deadlock and a match never sees half a batch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <deque>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

#include "candidates.hpp"
#include "events.hpp"
#include "kv_headers.hpp"
#include "nats_reader.hpp"
#include "prefix_index.hpp"
#include "seq.hpp"
#include "stack_distance.hpp"
#include "xxh3.hpp"

namespace py = pybind11;
using namespace cr;

namespace {

// An int's value when it is an exact int in [0, 2**64) read straight from its digits
// (CPython 3.11's layout; false: ask the C API). PyLong_AsUnsignedLongLong takes a
// 64-bit hash, three 30-bit digits, through _PyLong_AsByteArray: 32 ns a hash against
// 5.5 for a one-digit int (``Core.shared_at`` of 8K hashes, best of 50), and every
// match, store and forecast reads a request's hashes this way.
inline bool digits_u64(PyObject* o, uint64_t& out) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    if (!PyLong_CheckExact(o)) return false;
    const Py_ssize_t n = Py_SIZE(o);
    if (n < 0 || n > 3) return false;
    const digit* d = reinterpret_cast<PyLongObject*>(o)->ob_digit;
    if (n == 3 && (d[2] >> 4)) return false;  // 2**64 or more: the C API's error
    uint64_t v = 0;
    for (Py_ssize_t i = n; i-- > 0;) v = (v << PyLong_SHIFT) | d[i];
    out = v;
    return true;
#else
    (void)o;
    (void)out;
    return false;
#endif
}

// A Python sequence (or array('Q') / any u64 buffer) of hashes as u64s.
std::vector<uint64_t> u64s(py::handle obj) {
    std::vector<uint64_t> out;
    if (PyObject_CheckBuffer(obj.ptr()) && !PyBytes_Check(obj.ptr())) {
        py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
        if (info.itemsize == 8 && info.ndim == 1 && info.strides[0] == 8 &&
            (info.format == "Q" || info.format == "L" || info.format == "K" ||
             info.format == "=Q" || info.format == "<Q")) {
            const auto* p = static_cast<const uint64_t*>(info.ptr);
            out.assign(p, p + info.shape[0]);
            return out;
        }
    }
    PyObject* seq = PySequence_Fast(obj.ptr(), "block hashes must be a sequence of ints");
    if (!seq) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    out.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (digits_u64(items[i], out[static_cast<size_t>(i)])) continue;
        unsigned long long v = PyLong_AsUnsignedLongLong(items[i]);
        if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyErr_Clear();
            throw py::value_error("a block hash is not an int in [0, 2**64)");
        }
        out[static_cast<size_t>(i)] = v;
    }
    Py_DECREF(seq);
    return out;
}

// Token ids as u32s: from a buffer of little-endian u32 bytes, or a sequence of ints
// (converted here, ~3x faster than array("I", ids) in Python).
std::vector<uint32_t> u32s(py::handle obj) {
    std::vector<uint32_t> out;
    if (PyObject_CheckBuffer(obj.ptr())) {
        py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
        const size_t n = static_cast<size_t>(info.size * info.itemsize) / 4;
        out.resize(n);
        if (n) std::memcpy(out.data(), info.ptr, n * 4);  // an empty buffer's pointer may be null
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        for (auto& t : out) t = __builtin_bswap32(t);
#endif
        return out;
    }
    PyObject* seq = PySequence_Fast(obj.ptr(), "token ids must be a sequence of ints");
    if (!seq) throw py::error_already_set();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    out.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
        unsigned long v = PyLong_AsUnsignedLong(items[i]);
        if ((v == static_cast<unsigned long>(-1) && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            Py_DECREF(seq);
            PyErr_Clear();
            throw py::value_error("a token id is not an int in [0, 2**32)");
        }
        out[static_cast<size_t>(i)] = static_cast<uint32_t>(v);
    }
    Py_DECREF(seq);
    return out;
}

py::list to_list(const std::vector<uint64_t>& v) {
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(v.size()));
    if (!list) throw py::error_already_set();
    for (size_t i = 0; i < v.size(); ++i)
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyLong_FromUnsignedLongLong(v[i]));
    return py::reinterpret_steal<py::list>(list);
}

std::string_view bytes_of(const py::buffer& b, py::buffer_info& info) {
    info = b.request();
    return {static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

// ``match``'s optional flags of blocks shared in another group's core (None: none).
std::string shared_flags(const py::object& shared, size_t n) {
    if (shared.is_none()) return {};
    std::string ext = shared.cast<std::string>();
    if (ext.size() != n) throw py::value_error("shared flags must be one byte per hash");
    return ext;
}

void check_slot(int slot) {
    if (slot < 0 || slot >= MAX_SLOTS)
        throw py::value_error("the native index holds at most 64 workers");
}

void check_tier(int tier) {
    if (tier < 0 || tier >= NTIERS) throw py::value_error("tier must be 0..3");
}

struct Parsed {
    ParsedBatch batch;
};

py::dict errors_dict(const ApplyResult& r) {
    py::dict d;
    for (const auto& [k, v] : r.errors) d[py::str(k)] = v;
    return d;
}

int64_t rank_of(const py::object& rank) {
    return rank.is_none() ? NO_RANK : rank.cast<int64_t>();
}

Epoch epoch_of(const py::object& epoch) {
    Epoch e;
    if (!epoch.is_none()) e.has = true, e.text = epoch.cast<std::string>();
    return e;
}

py::object rank_obj(int64_t rank) {
    return rank == NO_RANK ? py::object(py::none()) : py::object(py::int_(rank));
}

py::dict rank_dict(const RankMap& m) {
    py::dict d;
    for (const auto& [r, s] : m.items()) d[rank_obj(r)] = s;
    return d;
}

// Status 7: the batch needs Python's decoder (``ParsedBatch.slow``); nothing changed.
constexpr int SEQ_SLOW = 7;
constexpr int APPLIED_BATCH = 1, RESTARTED = 2, WAS_RESET = 4;

// (status, expected seq or None, events applied, the batch's errors or None, errors
// counted on the ingest only or None, flags: APPLIED_BATCH | RESTARTED | WAS_RESET).
py::tuple outcome(const SeqDecision& d, const ApplyResult& r, const ParsedBatch* parsed) {
    py::object errors = py::none(), self_errors = py::none();
    const bool bad = parsed && d.apply && (parsed->bad_event || parsed->unknown_event);
    if (!r.errors.empty() || bad || d.status == SEQ_MALFORMED) {
        py::dict e = errors_dict(r);
        if (bad && parsed->bad_event)
            e["bad_event"] = e.attr("get")("bad_event", 0).cast<int64_t>() + parsed->bad_event;
        if (bad && parsed->unknown_event)
            e["unknown_event"] =
                e.attr("get")("unknown_event", 0).cast<int64_t>() + parsed->unknown_event;
        if (d.status == SEQ_MALFORMED) e["malformed_batch"] = 1;
        errors = e;
    }
    if (d.self_error || r.quota_cuts) {
        py::dict e;
        if (d.self_error) e[d.self_error] = 1;
        if (r.quota_cuts) e["worker_quota"] = r.quota_cuts;
        self_errors = e;
    }
    const int flags = (d.apply ? APPLIED_BATCH : 0) | (d.restarted ? RESTARTED : 0) |
                      (d.reset ? WAS_RESET : 0);
    py::object expected = py::none();
    if (d.has_expected)
        expected = d.past_max ? py::reinterpret_steal<py::object>(
                                    PyLong_FromUnsignedLongLong(uint64_t{1} << 63))
                              : py::object(py::int_(d.expected));
    return py::make_tuple(d.status, expected, r.applied, errors, self_errors, flags);
}

class Core {
   public:
    Core(uint64_t max_blocks, int bisect_min)
        : index(max_blocks, bisect_min),
          decoder({}),
          applier(index, 16, false, 0),
          rules(100000, 64),
          seq(MAX_SLOTS),
          gen(MAX_SLOTS, 0) {}

    PrefixCore index;
    EventDecoder decoder;
    EventApplier applier;
    SeqRules rules;
    std::vector<SeqState> seq;  // per slot
    // Per slot, bumped when the slot is given up: a route the event reader took for the
    // slot's former worker (LiveFeed, below) no longer applies to its next one.
    std::vector<uint64_t> gen;
    std::mutex mu;

    // Clear a worker's blocks, its engine-hash maps and (``all``) its seq state.
    void reset(int slot) {
        index.clear(slot);
        applier.worker(slot).clear();
    }

    // The seq check, a reset when it asks for one, the events, the commit: one step
    // under the mutex (the caller holds it), so a match sees the batch whole or not.
    void ingest(int slot, int64_t rank, int64_t seq_no, const Epoch& epoch,
                const std::vector<PEvent>* events, int64_t quota, SeqDecision& d,
                ApplyResult& r) {
        SeqState& w = seq[slot];
        d = events ? rules.decide(w, rank, seq_no, epoch)
                   : SeqRules::malformed(w, rank, seq_no, epoch);
        if (d.reset) reset(slot);
        if (!d.apply) return;
        applier.apply(slot, *events, quota, r);
        SeqRules::commit(w, rank, seq_no);
    }

    struct Lock {
        std::unique_lock<std::mutex> lk;
        explicit Lock(std::mutex& m) : lk(m, std::try_to_lock) {
            if (!lk.owns_lock()) {
                py::gil_scoped_release nogil;
                lk.lock();
            }
        }
    };
};

// index/reuse.py's StackDistance (stack_distance.hpp) and the mutex that keeps a report
// from reading it halfway through a request (the analysis runs with the GIL released).
struct Stack {
    StackDistance sd;
    std::mutex mu;

    Stack(int64_t max_tracked, bool full, uint64_t threshold, int64_t horizon, int64_t hot)
        : sd(max_tracked, full, threshold, horizon, hot) {}

    // A request this short is analysed with the GIL held: its ~80 ns a block cost less
    // than handing the GIL to the event loop and waiting to get it back, which at
    // saturation (short chats, two calls a request) cost the forecast's thread ~37 us a
    // request and the loop a forced switch per call (BENCHMARKS.md, session 12).
    static constexpr size_t NOGIL_BLOCKS = 256;

    void observe(py::handle hashes, int64_t num_tokens, int64_t block_size, bool count) {
        std::vector<uint64_t> hs = u64s(hashes);
        if (hs.size() < NOGIL_BLOCKS) {
            Core::Lock l(mu);  // a reader may hold it: waits with the GIL released
            sd.observe(hs.data(), hs.size(), num_tokens, block_size, count);
            return;
        }
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> l(mu);
        sd.observe(hs.data(), hs.size(), num_tokens, block_size, count);
    }
};

// A bytes object's contents (the caller holds the object while the view is used).
std::string_view bytes_view(py::handle h) {
    return {PyBytes_AS_STRING(h.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(h.ptr()))};
}

// A prepared event's engine hashes (ints, or the engine's bytes) as keys, each bytes
// hash's bytes viewed in ``ev.wide`` (the caller holds the tuple while it applies).
void engine_keys(py::handle obj, PEvent& ev) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
    bool any_bytes = false;
    for (py::handle h : seq) any_bytes |= PyBytes_Check(h.ptr()) != 0;
    if (!any_bytes) {
        ev.hashes = u64s(obj);
        return;
    }
    ev.hashes.reserve(seq.size());
    for (py::handle h : seq) {
        if (PyBytes_Check(h.ptr())) {
            const std::string_view b = bytes_view(h);
            ev.wide.emplace_back(static_cast<uint32_t>(ev.hashes.size()), b);
            ev.hashes.push_back(bytes_key(b));
        } else {
            ev.hashes.push_back(h.cast<uint64_t>());
        }
    }
}

uint64_t engine_key(py::handle h) {
    return PyBytes_Check(h.ptr()) ? bytes_key(bytes_view(h)) : h.cast<uint64_t>();
}

// A worker's engine hash as the engine named it, read under the core's mutex and made a
// Python object after it (no Python allocation, so no GC, while the mutex is held).
struct EngineName {
    uint64_t key;
    std::string bytes;
    Name how;

    EngineName(const WorkerBlocks& w, uint64_t k) : key(k), how(w.engine_name(k, bytes)) {}
    bool known() const { return how != Name::DROPPED; }
    py::object object() const {
        return how == Name::BYTES ? py::object(py::bytes(bytes)) : py::object(py::int_(key));
    }
};

PEvent event_from_tuple(const py::tuple& t) {
    PEvent ev;
    const std::string kind = t[0].cast<std::string>();
    if (kind == "cleared") {
        ev.kind = CLEARED;
        return ev;
    }
    ev.tier = t[1].cast<int>();
    ev.other_group = t[2].cast<bool>();
    engine_keys(t[3], ev);
    if (kind == "removed") {
        ev.kind = REMOVED;
        return ev;
    }
    if (kind != "stored") throw py::value_error("event kind must be stored/removed/cleared");
    ev.kind = STORED;
    if (!t[4].is_none()) ev.has_parent = true, ev.parent = engine_key(t[4]);
    if (t[5].is_none()) {
        ev.bad_tokens = true;  // counted as in Python: the length checks come first
        ev.tokens.resize(t[6].cast<size_t>());
    } else {
        py::buffer_info info;
        std::string_view tb = bytes_of(t[5].cast<py::buffer>(), info);
        ev.tokens.resize(tb.size() / 4);
        if (!ev.tokens.empty()) std::memcpy(ev.tokens.data(), tb.data(), ev.tokens.size() * 4);
    }
    ev.block_size = t[7].cast<int64_t>();
    if (!t[8].is_none()) ev.has_root = true, ev.root = t[8].cast<uint64_t>();
    if (!t[9].is_none()) {
        for (auto [k, v] : t[9].cast<py::dict>())
            ev.extras.emplace_back(k.cast<int64_t>(), v.cast<std::string>());
    }
    return ev;
}


// The native KV-event reader's half that knows the index (nats_reader.hpp reads the
// socket): a live batch that is a plain in-order apply for a worker Python routed here
// (``route``) is checked, decoded and applied on the reader's thread, under the core's
// mutex as ``ingest_many`` does; everything else (no route, a gap, another epoch, an
// unreadable header or payload, a batch Python must decode) is queued for Python's
// EventSync as the message itself, in arrival order. The queue is bounded: a message it
// has no room for is dropped and its worker named in ``poll``'s dropped list (Python
// marks it out of sync and resyncs it), never lost silently.
class LiveFeed : public NatsHandler {
   public:
    enum Kind { MESSAGE = 0, NOTED = 1, UP = 2, LOST = 3, FAIL = 4 };

    struct Record {
        int kind = MESSAGE;
        std::string subject, headers, payload, text;
        double queued = 0;
        // NOTED: applied here with something for Python to count (errors, quota cuts)
        std::string worker;
        int64_t rank = NO_RANK, seq = 0;
        Epoch epoch;
        SeqDecision d;
        ApplyResult r;
        ParsedBatch flags;  // bad/unknown event counts only (events moved out)
    };

    struct Route {
        Core* core;
        int slot;
        uint64_t gen;
        int64_t rank, quota;
        int64_t batches = 0, events = 0;
    };

    LiveFeed(NatsOptions opts, std::string prefix, size_t max_queued, size_t max_queued_bytes)
        : prefix_(std::move(prefix)), max_queued_(max_queued),
          max_queued_bytes_(max_queued_bytes), reader_(std::move(opts), *this) {
        if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) throw std::runtime_error("pipe failed");
    }
    ~LiveFeed() override {
        reader_.stop();
        ::close(wake_[0]);
        ::close(wake_[1]);
    }

    void start() { reader_.start(); }
    void stop() { reader_.stop(); }
    int wake_fd() const { return wake_[0]; }

    void route(const std::string& worker, Core* core, int slot, int64_t rank, int64_t quota) {
        uint64_t gen;
        {
            std::lock_guard<std::mutex> l(core->mu);
            gen = core->gen[slot];
        }
        std::lock_guard<std::mutex> l(routes_mu_);
        auto [it, fresh] = routes_.try_emplace(worker, Route{core, slot, gen, rank, quota});
        if (!fresh) {
            Route& r = it->second;
            r.core = core, r.slot = slot, r.gen = gen, r.rank = rank, r.quota = quota;
        }
    }

    void unroute(const std::string& worker) {
        std::lock_guard<std::mutex> l(routes_mu_);
        routes_.erase(worker);
    }

    // (records, workers whose messages were dropped, all dropped, (worker, batches,
    // events) applied here since the last poll); at most ``max`` records.
    void take(size_t max, std::vector<Record>& out, std::vector<std::string>& dropped,
              bool& dropped_all, std::vector<std::tuple<std::string, int64_t, int64_t>>& applied,
              bool& more) {
        wake_pending_ = false;
        char sink[256];
        while (::read(wake_[0], sink, sizeof sink) > 0) {
        }
        {
            std::lock_guard<std::mutex> l(q_mu_);
            while (!queue_.empty() && out.size() < max) {
                queued_bytes_ -= queue_.front().payload.size();
                out.push_back(std::move(queue_.front()));
                queue_.pop_front();
            }
            more = !queue_.empty();
            dropped.assign(dropped_.begin(), dropped_.end());
            dropped_.clear();
            dropped_all = dropped_all_;
            dropped_all_ = false;
        }
        std::lock_guard<std::mutex> l(routes_mu_);
        for (auto& [w, r] : routes_) {
            if (!r.batches) continue;
            applied.emplace_back(w, r.batches, r.events);
            r.batches = r.events = 0;
        }
    }

    std::pair<size_t, double> lag() {
        std::lock_guard<std::mutex> l(q_mu_);
        if (queue_.empty()) return {0, 0.0};
        return {queue_.size(), now() - queue_.front().queued};
    }

    std::atomic<int64_t> messages{0}, applied_here{0}, queue_full{0}, oversized{0}, failed{0};
    std::atomic<bool> up{false};

    // -- on the reader's thread ----------------------------------------------------
    void on_up() override {
        up = true;
        control(UP, "");
    }
    void on_lost(const std::string& why) override {
        up = false;
        control(LOST, why);
    }
    void on_fail(const std::string& why) override {  // news only: within the bound
        Record rec;
        rec.kind = FAIL;
        rec.text = why;
        push_anyway(std::move(rec));
    }

    void on_oversized(std::string_view subject) override {
        ++oversized;
        dropped(subject);
    }

    void on_message(std::string_view subject, std::string_view headers,
                    std::string_view payload) override {
        ++messages;
        bool applied;
        try {
            applied = try_apply(subject, headers, payload);
        } catch (const std::exception&) {
            // bad_alloc, or a table at its size bound (length_error), maybe half way
            // through the batch: an exception must never end the reader's thread (and
            // with it the process); the worker is resynced, as for a dropped message.
            ++failed;
            dropped(subject);
            return;
        }
        if (!applied) {
            Record rec;
            rec.subject.assign(subject);
            rec.headers.assign(headers);
            rec.payload.assign(payload);
            push(std::move(rec), subject);
        }
    }

   private:
    static double now() {
        return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    }

    // Applied here: true. False: nothing changed, Python takes the message.
    bool try_apply(std::string_view subject, std::string_view headers, std::string_view payload) {
        if (subject.size() <= prefix_.size() || subject.substr(0, prefix_.size()) != prefix_)
            return false;
        const std::string worker(subject.substr(prefix_.size()));
        std::string_view status;
        if (headers.empty() || !parse_headers(headers, status, kv_) || !status.empty())
            return false;
        KvHeaders h;
        if (!read_kv_headers(kv_, h) || !h.has_seq) return false;
        const int64_t seq = h.seq, rank = h.rank;
        const Epoch& epoch = h.epoch;
        Route route{};
        {
            std::lock_guard<std::mutex> l(routes_mu_);
            auto it = routes_.find(worker);
            if (it == routes_.end()) return false;
            route = it->second;
        }
        if (route.rank != rank) return false;
        Core& c = *route.core;
        ParsedBatch parsed;
        try {
            c.decoder.parse(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(),
                            parsed);
        } catch (const DecodeError&) {
            return false;
        }
        if (parsed.slow) return false;
        SeqDecision d;
        ApplyResult r;
        {
            std::lock_guard<std::mutex> l(c.mu);
            const SeqState& w = c.seq[route.slot];
            if (c.gen[route.slot] != route.gen || !w.known || !w.in_sync || w.epoch != epoch)
                return false;
            const int64_t* last = w.last.find(rank);
            if (!last || !SeqRules::follows(*last, seq)) return false;
            c.ingest(route.slot, rank, seq, epoch, &parsed.events, route.quota, d, r);
        }
        ++applied_here;
        const bool plain = d.apply && d.status == SEQ_OK && !d.restarted && !d.reset &&
                           !d.self_error && r.errors.empty() && !r.quota_cuts &&
                           !parsed.bad_event && !parsed.unknown_event;
        if (plain) {
            std::lock_guard<std::mutex> l(routes_mu_);
            auto it = routes_.find(worker);
            if (it != routes_.end()) ++it->second.batches, it->second.events += r.applied;
            return true;
        }
        Record rec;  // applied: Python counts what it said (NativeEventIngest._outcome)
        rec.kind = NOTED;
        rec.worker = worker;
        rec.payload.assign(payload);
        rec.rank = rank, rec.seq = seq, rec.epoch = epoch, rec.d = d, rec.r = std::move(r);
        rec.flags.bad_event = parsed.bad_event, rec.flags.unknown_event = parsed.unknown_event;
        if (!push_anyway(std::move(rec))) {
            // Its counts are lost, not the batch: the worker is resynced all the same,
            // so the gap in the counters is the only thing the drop costs.
            dropped(subject);
        }
        return true;
    }

    // A name longer than this is no worker's (the router's ids are 128 bytes at most): a
    // message on it is counted, and nobody is resynced for it (a long subject, which a
    // server with a larger max_control_line forwards, must not mark every worker).
    static constexpr size_t MAX_NAME = 1024;

    void dropped(std::string_view subject) {
        ++queue_full;
        std::lock_guard<std::mutex> l(q_mu_);
        if (subject.size() > prefix_.size() + MAX_NAME) return;
        if (subject.size() > prefix_.size() && subject.substr(0, prefix_.size()) == prefix_ &&
            dropped_.size() < 1024)
            dropped_.insert(std::string(subject.substr(prefix_.size())));
        else
            dropped_all_ = true;
        wake();
    }

    void push(Record&& rec, std::string_view subject) {
        if (!push_anyway(std::move(rec))) dropped(subject);
    }

    bool push_anyway(Record&& rec) {
        std::lock_guard<std::mutex> l(q_mu_);
        if (queue_.size() >= max_queued_ || queued_bytes_ + rec.payload.size() > max_queued_bytes_)
            return false;
        rec.queued = now();
        queued_bytes_ += rec.payload.size();
        queue_.push_back(std::move(rec));
        wake();
        return true;
    }

    // A session's start and end: two per connection, never refused (refusing one
    // would hide a loss, or the resync after it).
    void control(int kind, const std::string& why) {
        Record rec;
        rec.kind = kind;
        rec.text = why;
        std::lock_guard<std::mutex> l(q_mu_);
        rec.queued = now();
        queue_.push_back(std::move(rec));
        wake();
    }

    void wake() {  // under q_mu_
        if (!wake_pending_.exchange(true)) {
            const char b = 1;
            (void)!::write(wake_[1], &b, 1);
        }
    }

    std::string prefix_;
    size_t max_queued_, max_queued_bytes_, queued_bytes_ = 0;
    std::mutex routes_mu_, q_mu_;
    std::unordered_map<std::string, Route> routes_;
    std::deque<Record> queue_;
    std::set<std::string> dropped_;
    bool dropped_all_ = false;
    std::atomic<bool> wake_pending_{false};
    int wake_[2];
    std::vector<std::pair<std::string_view, std::string_view>> kv_;  // reader thread only
    NatsReader reader_;  // last: its thread stops before the rest is destroyed
};

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "cache-router's native core: XXH3-64, rolling block hashes, index, event ingest";
    m.attr("MAX_WORKERS") = MAX_SLOTS;

    m.def(
        "xxh3_64",
        [](py::buffer data, uint64_t seed) {
            py::buffer_info info;
            std::string_view b = bytes_of(data, info);
            return xxh3_64(b.data(), b.size(), seed);
        },
        py::arg("data"), py::arg("seed") = 0, "XXH3-64 of ``data``; equals xxhash.xxh3_64_intdigest.");

    m.def(
        "rolling_hashes",
        [](py::handle tokens_obj, int64_t block_size, bool bigram, uint64_t seed) {
            if (block_size <= 0) throw py::value_error("block_size must be positive");
            std::vector<uint32_t> tokens = u32s(tokens_obj);
            std::vector<uint64_t> out;
            {
                py::gil_scoped_release nogil;
                rolling_hashes(tokens.data(), tokens.size(), static_cast<size_t>(block_size),
                               bigram, seed, out);
            }
            return to_list(out);
        },
        py::arg("tokens"), py::arg("block_size"), py::arg("bigram"), py::arg("seed"),
        "Rolling xxh3_64 hashes of every full block of ``tokens``: a sequence of ints or\n"
        "little-endian u32 bytes. Bit-identical to index.hashing's Python loop.");

    m.def("table_hash", &keyed_mix, py::arg("key"),
          "The native hash tables' slot hash of ``key``, keyed per process (keyed.hpp).");

    py::class_<Stack>(m, "StackDistance")
        .def(py::init([](int64_t max_tracked, bool full, uint64_t threshold,
                         int64_t horizon, int64_t hot_blocks) {
                 if (max_tracked < 1) throw py::value_error("max_tracked must be >= 1");
                 if (max_tracked > (int64_t{1} << 30))
                     throw py::value_error("max_tracked must be <= 2**30");
                 if (hot_blocks < 0) throw py::value_error("hot_blocks must be >= 0");
                 return std::make_unique<Stack>(max_tracked, full, threshold, horizon, hot_blocks);
             }),
             py::arg("max_tracked"), py::arg("full"), py::arg("threshold"), py::arg("horizon"),
             py::arg("hot_blocks"),
             "``full``: every hash sampled, else those below ``threshold``; horizon < 0: none.")
        .def(
            "observe",
            [](Stack& s, py::handle hashes, int64_t num_tokens, int64_t block_size) {
                if (block_size <= 0) throw py::value_error("block_size must be positive");
                s.observe(hashes, num_tokens, block_size, true);
            },
            py::arg("hashes"), py::arg("num_tokens"), py::arg("block_size"),
            "One request's full blocks, GIL released: depths, histogram, stack, bounds.")
        .def(
            "touch",
            [](Stack& s, py::handle hashes) { s.observe(hashes, 0, 1, false); },
            py::arg("hashes"), "Blocks used without a request (a prefetch): no hit recorded.")
        .def("state",
             [](Stack& s) {
                 Core::Lock l(s.mu);
                 const StackDistance& d = s.sd;
                 return py::make_tuple(d.full, d.threshold, d.tracked(), d.tokens, d.requests,
                                       d.accesses, d.sampled);
             },
             "(full, threshold, tracked, tokens, requests, accesses, sampled).")
        .def("curve",
             [](Stack& s) {
                 Core::Lock l(s.mu);
                 return py::make_tuple(s.sd.buckets, s.sd.tokens, s.sd.requests);
             },
             "(histogram, tokens, requests), read at one instant.")
        .def("bytes", [](Stack& s) {
            Core::Lock l(s.mu);
            return s.sd.bytes();
        });

    py::class_<Parsed>(m, "ParsedBatch")
        .def_property_readonly("ts", [](const Parsed& p) { return p.batch.ts; })
        .def_property_readonly("dp_rank",
                               [](const Parsed& p) -> py::object {
                                   if (!p.batch.has_dp) return py::none();
                                   return py::int_(p.batch.dp);
                               })
        .def_property_readonly("slow", [](const Parsed& p) { return p.batch.slow; })
        .def_property_readonly("num_events",
                               [](const Parsed& p) { return p.batch.events.size(); })
        .def_property_readonly("errors", [](const Parsed& p) {
            py::dict d;
            if (p.batch.bad_event) d["bad_event"] = p.batch.bad_event;
            if (p.batch.unknown_event) d["unknown_event"] = p.batch.unknown_event;
            return d;
        });

    py::class_<Core>(m, "Core")
        .def(py::init<uint64_t, int>(), py::arg("max_blocks"), py::arg("bisect_min_blocks"))
        .def(
            "configure_events",
            [](Core& c, int64_t block_size, bool bigram, uint64_t seed,
               const std::unordered_map<std::string, int>& tiers) {
                if (block_size <= 0) throw py::value_error("block_size must be positive");
                Core::Lock l(c.mu);
                c.applier.configure(block_size, bigram, seed);
                c.decoder.set_tiers(tiers);
            },
            py::arg("block_size"), py::arg("bigram"), py::arg("seed"), py::arg("tiers"),
            "How events are rehashed (the pool's BlockHasher) and media map to tiers.")
        .def(
            "keep_names",
            [](Core& c, bool keep) {
                Core::Lock l(c.mu);
                try {
                    c.applier.set_keep_names(keep);
                } catch (const std::logic_error& e) {
                    throw py::value_error(e.what());
                }
            },
            py::arg("keep"),
            "Whether blocks keep the bytes engines named them by (prefetch hints read "
            "them); set before any event.")
        .def("add_slot",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 c.index.add_slot(slot);
             })
        .def("drop_slot",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 c.index.drop_slot(slot);
                 c.applier.worker(slot).clear();
                 c.seq[slot].forget();
                 ++c.gen[slot];
             })
        .def("clear",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 c.index.clear(slot);
             })
        .def("reset_worker",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 c.index.clear(slot);
                 c.applier.worker(slot).clear();
             })
        .def("store",
             [](Core& c, int slot, py::handle hashes, int tier, py::object parent) {
                 check_slot(slot);
                 check_tier(tier);
                 std::vector<uint64_t> hs = u64s(hashes);
                 const bool has_parent = !parent.is_none();
                 const uint64_t p = has_parent ? parent.cast<uint64_t>() : 0;
                 Core::Lock l(c.mu);
                 c.index.store(slot, hs.data(), hs.size(), tier, has_parent, p);
             })
        .def("remove",
             [](Core& c, int slot, py::handle hashes, int tier) {
                 check_slot(slot);
                 check_tier(tier);
                 std::vector<uint64_t> hs = u64s(hashes);
                 Core::Lock l(c.mu);
                 c.index.remove(slot, hs.data(), hs.size(), tier);
             })
        .def("holds",
             [](Core& c, int slot, uint64_t block, int tier) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 return c.index.holds(slot, block, tier);
             })
        .def("predict",
             [](Core& c, int slot, py::handle hashes, double expiry) {
                 check_slot(slot);
                 std::vector<uint64_t> hs = u64s(hashes);
                 Core::Lock l(c.mu);
                 c.index.predict(slot, hs.data(), hs.size(), expiry);
             })
        .def("shared_total",
             [](Core& c) {
                 Core::Lock l(c.mu);
                 return c.index.shared_total();
             })
        .def("shared_at",
             [](Core& c, py::handle hashes) {
                 std::vector<uint64_t> hs = u64s(hashes);
                 std::string out(hs.size(), '\0');
                 {
                     Core::Lock l(c.mu);
                     c.index.shared_at(hs.data(), hs.size(), reinterpret_cast<uint8_t*>(out.data()));
                 }
                 return py::bytes(out);
             },
             "One byte per hash: 1 where this core holds it in the shared tier.")
        .def("match",
             [](Core& c, py::handle hashes, bool speculative, double now, py::object shared) {
                 std::vector<uint64_t> hs = u64s(hashes);
                 std::string ext = shared_flags(shared, hs.size());
                 Depths d;
                 {
                     Core::Lock l(c.mu);
                     c.index.depths(hs.data(), hs.size(), speculative, now, d,
                                    ext.empty() ? nullptr : reinterpret_cast<const uint8_t*>(ext.data()));
                 }
                 py::list out;
                 for (Mask m = d.found; m; m &= m - 1) {
                     const int s = __builtin_ctzll(m);
                     out.append(py::make_tuple(s, d.depth[s]));
                 }
                 return out;
             },
             py::arg("hashes"), py::arg("speculative"), py::arg("now"), py::arg("shared") = py::none())
        .def("match_tiers",
             [](Core& c, py::handle hashes, bool speculative, double now, py::object shared) {
                 std::vector<uint64_t> hs = u64s(hashes);
                 std::string ext = shared_flags(shared, hs.size());
                 Depths d;
                 TierDepths t;
                 Mask split;
                 {
                     Core::Lock l(c.mu);
                     c.index.depths(hs.data(), hs.size(), speculative, now, d,
                                    ext.empty() ? nullptr : reinterpret_cast<const uint8_t*>(ext.data()));
                     split = c.index.split_tiers(hs.data(), hs.size(), speculative, d, t, !ext.empty());
                 }
                 py::list out;
                 for (Mask m = d.found; m; m &= m - 1) {
                     const int s = __builtin_ctzll(m);
                     const int total = d.depth[s];
                     if (split & (Mask{1} << s))
                         out.append(py::make_tuple(s, t.gpu[s], t.cpu[s], t.disk[s], total));
                     else
                         out.append(py::make_tuple(s, total, total, total, total));
                 }
                 return out;
             },
             py::arg("hashes"), py::arg("speculative"), py::arg("now"), py::arg("shared") = py::none())
        .def("__len__",
             [](Core& c) {
                 Core::Lock l(c.mu);
                 return c.index.size();
             })
        .def("speculative",
             [](Core& c) {
                 Core::Lock l(c.mu);
                 return c.index.speculative();
             })
        .def("counts",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 const int64_t* k = c.index.counts(slot);
                 return py::make_tuple(k[0], k[1], k[2], k[3]);
             })
        .def("holey",
             [](Core& c) {
                 Core::Lock l(c.mu);
                 return c.index.holey_count();
             })
        .def("counters",
             [](Core& c) {
                 Core::Lock l(c.mu);
                 return py::make_tuple(c.index.dropped, c.index.spec_confirmed,
                                       c.index.spec_expired);
             })
        .def("scans",
             [](Core& c) {
                 Core::Lock l(c.mu);
                 return py::make_tuple(c.index.clear_scans, c.index.evict_scans);
             },
             "Scans of every node so far: (by clears, by eviction rounds).")
        .def("bytes",
             [](Core& c) {
                 Core::Lock l(c.mu);
                 return py::make_tuple(c.index.bytes(), c.applier.bytes());
             },
             "Heap bytes held by (the index, the per-worker engine-hash maps).")
        // -- events ------------------------------------------------------------------
        .def("parse",
             [](Core& c, py::buffer payload) {
                 py::buffer_info info;
                 std::string_view b = bytes_of(payload, info);
                 auto parsed = std::make_unique<Parsed>();
                 std::string error;
                 {
                     py::gil_scoped_release nogil;
                     try {
                         c.decoder.parse(reinterpret_cast<const uint8_t*>(b.data()), b.size(),
                                         parsed->batch);
                     } catch (const DecodeError& e) {
                         error = e.what();
                     }
                 }
                 if (!error.empty()) throw py::value_error(error);
                 return parsed;
             },
             "Decode one msgpack EventBatch; ValueError when it is not one.")
        .def("apply_parsed",
             [](Core& c, int slot, const Parsed& p, int64_t quota) {
                 check_slot(slot);
                 ApplyResult r;
                 {
                     py::gil_scoped_release nogil;
                     std::lock_guard<std::mutex> l(c.mu);
                     c.applier.apply(slot, p.batch.events, quota, r);
                 }
                 if (p.batch.bad_event) r.errors["bad_event"] += p.batch.bad_event;
                 if (p.batch.unknown_event) r.errors["unknown_event"] += p.batch.unknown_event;
                 return py::make_tuple(r.applied, errors_dict(r), r.quota_cuts);
             },
             py::arg("slot"), py::arg("batch"), py::arg("quota") = -1,
             "Apply a parsed (not slow) batch's events for one worker, all under one lock.\n"
             "Returns (events applied, errors by name, stores cut short by ``quota``).")
        .def("apply_events",
             [](Core& c, int slot, const py::list& events, int64_t quota) {
                 check_slot(slot);
                 std::vector<PEvent> evs;
                 evs.reserve(events.size());
                 for (py::handle e : events) evs.push_back(event_from_tuple(e.cast<py::tuple>()));
                 ApplyResult r;
                 {
                     py::gil_scoped_release nogil;
                     std::lock_guard<std::mutex> l(c.mu);
                     c.applier.apply(slot, evs, quota, r);
                 }
                 return py::make_tuple(r.applied, errors_dict(r), r.quota_cuts);
             },
             py::arg("slot"), py::arg("events"), py::arg("quota") = -1,
             "Apply events prepared in Python (the slow path), all under one lock.")
        // -- sequence tracking (index/native/seq.hpp) --------------------------------
        .def(
            "configure_seq",
            [](Core& c, int64_t max_seq_jump, int64_t max_ranks) {
                Core::Lock l(c.mu);
                c.rules.configure(max_seq_jump, max_ranks);
            },
            py::arg("max_seq_jump"), py::arg("max_ranks"))
        .def(
            "ingest",
            [](Core& c, int slot, py::object rank, int64_t seq, py::object epoch,
               py::buffer payload, int64_t quota) -> py::object {
                check_slot(slot);
                const int64_t r = rank_of(rank);
                const Epoch e = epoch_of(epoch);
                py::buffer_info info;
                std::string_view b = bytes_of(payload, info);
                ParsedBatch parsed;
                SeqDecision d;
                ApplyResult res;
                bool slow = false;
                {
                    py::gil_scoped_release nogil;
                    bool ok = true;
                    try {
                        c.decoder.parse(reinterpret_cast<const uint8_t*>(b.data()), b.size(),
                                        parsed);
                    } catch (const DecodeError&) {
                        ok = false;
                    }
                    slow = ok && parsed.slow;
                    if (!slow) {
                        std::lock_guard<std::mutex> l(c.mu);
                        c.ingest(slot, r, seq, e, ok ? &parsed.events : nullptr, quota, d, res);
                    }
                }
                if (slow) return py::make_tuple(SEQ_SLOW, py::none(), 0, py::none(), py::none(), 0);
                return outcome(d, res, &parsed);
            },
            py::arg("slot"), py::arg("rank"), py::arg("seq"), py::arg("epoch"),
            py::arg("payload"), py::arg("quota") = -1,
            "Check, decode and apply one msgpack batch, GIL released, one lock: returns\n"
            "(status, expected seq, events applied, errors, ingest-only errors, flags);\n"
            "status 7 leaves a batch Python must decode (nothing changed).")
        .def(
            "ingest_many",
            [](Core& c, const py::list& items, int64_t quota) {
                // Python's part once per run of batches, not per batch: read every item
                // first (GIL held), then check, decode and apply them in order with the
                // GIL released, each batch under the mutex on its own (a match waits
                // for one batch at most, and may take the mutex between two).
                struct Item {
                    int slot;
                    int64_t rank, seq;
                    Epoch epoch;
                    py::buffer_info info;
                    std::string_view bytes;
                };
                std::vector<Item> in(items.size());
                for (size_t i = 0; i < in.size(); ++i) {
                    py::tuple t = items[i].cast<py::tuple>();
                    if (t.size() != 5)
                        throw py::value_error("an item is (slot, rank, seq, epoch, payload)");
                    Item& it = in[i];
                    it.slot = t[0].cast<int>();
                    check_slot(it.slot);
                    it.rank = rank_of(t[1]);
                    it.seq = t[2].cast<int64_t>();
                    it.epoch = epoch_of(t[3]);
                    it.bytes = bytes_of(t[4].cast<py::buffer>(), it.info);
                }
                std::vector<SeqDecision> ds(in.size());
                std::vector<ApplyResult> rs(in.size());
                std::vector<ParsedBatch> ps(in.size());
                size_t done = 0;
                bool slow = false;
                {
                    py::gil_scoped_release nogil;
                    for (; done < in.size(); ++done) {
                        Item& it = in[done];
                        bool ok = true;
                        try {
                            c.decoder.parse(reinterpret_cast<const uint8_t*>(it.bytes.data()),
                                            it.bytes.size(), ps[done]);
                        } catch (const DecodeError&) {
                            ok = false;
                        }
                        if (ok && ps[done].slow) {
                            slow = true;
                            break;
                        }
                        {
                            std::lock_guard<std::mutex> l(c.mu);
                            c.ingest(it.slot, it.rank, it.seq, it.epoch,
                                     ok ? &ps[done].events : nullptr, quota, ds[done], rs[done]);
                        }
                        // outcome() reads only its counts: the events go now, so the
                        // next batch's allocations reuse their memory (malloc's per-thread
                        // cache; freed together at the end of a run of 64 they took the
                        // allocator's slow paths, ~10 % of the run's instructions)
                        std::vector<PEvent>().swap(ps[done].events);
                        const SeqDecision& d = ds[done];
                        const ApplyResult& r = rs[done];
                        const bool plain = ok && d.apply && d.status == SEQ_OK && !d.restarted &&
                                           !d.reset && !d.self_error && r.errors.empty() &&
                                           !r.quota_cuts && !ps[done].bad_event &&
                                           !ps[done].unknown_event;
                        if (!plain) {
                            ++done;  // the caller reads this outcome before the rest
                            break;
                        }
                    }
                }
                py::list out;
                for (size_t i = 0; i < done; ++i) out.append(outcome(ds[i], rs[i], &ps[i]));
                if (slow) out.append(py::make_tuple(SEQ_SLOW, py::none(), 0, py::none(), py::none(), 0));
                return out;
            },
            py::arg("items"), py::arg("quota") = -1,
            "``ingest`` for a run of batches, (slot, rank, seq, epoch, payload) each, in\n"
            "order: their outcomes, up to and including the first that is not a plain\n"
            "applied batch (status 7, slow: nothing of it changed); the caller hands the\n"
            "rest in again once it read that one.")
        .def(
            "ingest_events",
            [](Core& c, int slot, py::object rank, int64_t seq, py::object epoch,
               py::object events, int64_t quota) {
                check_slot(slot);
                const int64_t r = rank_of(rank);
                const Epoch e = epoch_of(epoch);
                std::vector<PEvent> evs;
                const bool malformed = events.is_none();
                if (!malformed) {
                    py::list lst = events.cast<py::list>();
                    evs.reserve(lst.size());
                    for (py::handle ev : lst) evs.push_back(event_from_tuple(ev.cast<py::tuple>()));
                }
                SeqDecision d;
                ApplyResult res;
                {
                    py::gil_scoped_release nogil;
                    std::lock_guard<std::mutex> l(c.mu);
                    c.ingest(slot, r, seq, e, malformed ? nullptr : &evs, quota, d, res);
                }
                return outcome(d, res, nullptr);
            },
            py::arg("slot"), py::arg("rank"), py::arg("seq"), py::arg("epoch"),
            py::arg("events"), py::arg("quota") = -1,
            "``ingest`` for events prepared in Python (None: the batch was unreadable).")
        .def(
            "load_dump",
            [](Core& c, int slot, py::object rank, int64_t seq, py::object epoch,
               const py::list& events, int64_t quota) {
                check_slot(slot);
                const int64_t r = rank_of(rank);
                const Epoch e = epoch_of(epoch);
                std::vector<PEvent> evs;
                evs.reserve(events.size());
                for (py::handle ev : events) evs.push_back(event_from_tuple(ev.cast<py::tuple>()));
                ApplyResult res;
                {
                    py::gil_scoped_release nogil;
                    std::lock_guard<std::mutex> l(c.mu);
                    c.reset(slot);
                    SeqRules::load_dump(c.seq[slot], r, seq, e);
                    c.applier.apply(slot, evs, quota, res);
                }
                return py::make_tuple(res.applied, errors_dict(res), res.quota_cuts);
            },
            py::arg("slot"), py::arg("rank"), py::arg("seq"), py::arg("epoch"),
            py::arg("events"), py::arg("quota") = -1,
            "Replace the worker with a full dump taken at ``seq`` (prepared events).")
        .def("in_sync",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 return c.seq[slot].in_sync;
             })
        .def("out_of_sync",
             [](Core& c) {
                 Mask out = 0;
                 Core::Lock l(c.mu);
                 for (int s = 0; s < MAX_SLOTS; ++s)
                     if (!c.seq[static_cast<size_t>(s)].in_sync) out |= Mask{1} << s;
                 return out;
             },
             "The slots ``in_sync`` is false for, as a mask: one call a request for all "
             "candidates (16 calls of ``in_sync`` cost ~3 us a request at 16 workers).")
        .def("mark_out_of_sync",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 c.seq[slot].known = true;
                 c.seq[slot].in_sync = false;
             })
        .def("forget_unconfirmed",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 SeqRules::forget_unconfirmed(c.seq[slot]);
             })
        .def("epoch",
             [](Core& c, int slot) -> py::object {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 const Epoch& e = c.seq[slot].epoch;
                 return e.has ? py::object(py::str(e.text)) : py::object(py::none());
             },
             "The slot's engine life (``seq_state``'s third item, without the rest): every\n"
             "live batch reads it.")
        .def("seq_state",
             [](Core& c, int slot) {
                 check_slot(slot);
                 Core::Lock l(c.mu);
                 const SeqState& w = c.seq[slot];
                 py::object epoch = w.epoch.has ? py::object(py::str(w.epoch.text)) : py::none();
                 return py::make_tuple(w.known, w.in_sync, epoch, rank_dict(w.last),
                                       rank_dict(w.seen));
             },
             "(known, in sync, epoch, last applied seq by rank, highest seen by rank).")
        .def("engine_blocks",
             [](Core& c, int slot) {
                 check_slot(slot);
                 std::vector<std::pair<EngineName, uint64_t>> held;
                 {
                     Core::Lock l(c.mu);
                     auto& w = c.applier.worker(slot);
                     w.for_each([&](uint64_t eh, uint64_t router) {
                         EngineName name(w, eh);
                         if (name.known()) held.emplace_back(std::move(name), router);
                     });
                 }
                 py::dict out;
                 for (const auto& [name, router] : held) out[name.object()] = py::int_(router);
                 return out;
             },
             "Engine hash (its bytes, or the int) -> router hash of every block held "
             "(without the blocks named by bytes that were not kept).")
        .def("engine_hashes",
             [](Core& c, int slot, py::handle router_hashes) {
                 check_slot(slot);
                 std::vector<uint64_t> hs = u64s(router_hashes);
                 std::vector<EngineName> names;
                 {
                     Core::Lock l(c.mu);
                     auto& w = c.applier.worker(slot);
                     uint64_t eh;
                     for (uint64_t rh : hs) {
                         if (!w.engine_of(rh, eh) || !w.find(eh)) break;
                         EngineName name(w, eh);
                         if (!name.known()) break;  // named by bytes not kept: no hint names it
                         names.push_back(std::move(name));
                     }
                 }
                 py::list out;
                 for (const EngineName& n : names) out.append(n.object());
                 return out;
             },
             "The worker's own hashes of the leading ``router_hashes`` it holds.");

    // -- the native KV-event reader (nats_reader.hpp, LiveFeed) ----------------------
    py::class_<LoadBoard>(m, "LoadBoard")
        .def(py::init<>())
        .def("set", &LoadBoard::set, py::arg("slot"), py::arg("requests"), py::arg("tokens"),
             "The target's load key: in-flight requests, then their prefill tokens.")
        .def("block", &LoadBoard::block, py::arg("slot"), py::arg("blocked"))
        .def("drop", &LoadBoard::drop, py::arg("slot"))
        .def("seed", &LoadBoard::seed, py::arg("seed"))
        .def("place", &LoadBoard::place, py::arg("slot"), py::arg("rank"),
             "The slot's place in the candidate order: ``pick`` and ``least`` hand out their\n"
             "slots ordered by it (a slot never placed: by its own number).")
        .def("__len__", &LoadBoard::size)
        .def(
            "least",
            [](LoadBoard& b, int k, int cap, std::vector<int> also) {
                if (k < 1 || k > 64 || cap < 0)
                    throw py::value_error("least: k in 1..64 and cap >= 0");
                std::vector<int> out;
                b.least(k, cap, also, out);
                return out;
            },
            py::arg("k"), py::arg("cap"), py::arg("also") = std::vector<int>{},
            "The pool's least loaded slots without an index walk (a policy that does not\n"
            "weigh hits): the k least in each of the two orders and the tie at the k-th key\n"
            "(whole when at most ``cap`` more, else sampled), then the ``also`` slots; each\n"
            "once. O((k + cap) log n).")
        .def(
            "pick",
            [](LoadBoard& b, py::list cores, py::handle hashes, bool speculative, double now,
               int k, int cap, std::vector<int> also) {
                if (k < 1 || k > 64 || cap < 0)
                    throw py::value_error("pick: k in 1..64 and cap >= 0");
                std::vector<uint64_t> hs = u64s(hashes);  // once for every group
                std::vector<Core*> cs;
                for (py::handle c : cores) cs.push_back(&c.cast<Core&>());
                // several groups: the shared tier any of them holds counts in every walk
                // (NativePrefixIndex._shared)
                std::string ext;
                if (cs.size() > 1 && !hs.empty()) {
                    std::string flags(hs.size(), '\0'), mine(hs.size(), '\0');
                    bool any = false;
                    for (Core* c : cs) {
                        Core::Lock l(c->mu);
                        if (!c->index.shared_total()) continue;
                        c->index.shared_at(hs.data(), hs.size(), reinterpret_cast<uint8_t*>(mine.data()));
                        for (size_t i = 0; i < hs.size(); ++i) flags[i] |= mine[i];
                        any = true;
                    }
                    if (any) ext.swap(flags);
                }
                const uint8_t* shared = ext.empty() ? nullptr : reinterpret_cast<const uint8_t*>(ext.data());
                std::vector<Held> held;
                if (!hs.empty()) {
                    // the boundaries the groups walked so far found (each hit depth d: its
                    // last block d - 1 and d), probed first in the next groups' walks: the
                    // same prefixes are held in many groups, so most find their holders'
                    // ends in a few probes (a gallop and bisect cost ~16 each: at 1,024
                    // targets, bench/scale.py, the walks were half a pick's samples under
                    // perf, ~3/4 of them waiting on the tables' memory)
                    std::vector<int64_t> seeds;
                    constexpr size_t MAX_SEEDS = 16;
                    for (size_t g = 0; g < cs.size(); ++g) {
                        Depths d;
                        TierDepths t;
                        Mask split;
                        {
                            Core::Lock l(cs[g]->mu);
                            cs[g]->index.depths(hs.data(), hs.size(), speculative, now, d, shared,
                                                &seeds);
                            split = cs[g]->index.split_tiers(hs.data(), hs.size(), speculative, d, t,
                                                             shared != nullptr);
                        }
                        const int base = static_cast<int>(g) * MAX_SLOTS;
                        for (Mask m = d.found; m; m &= m - 1) {
                            const int s = __builtin_ctzll(m);
                            const int total = d.depth[s];
                            if (seeds.size() < MAX_SEEDS &&
                                !std::binary_search(seeds.begin(), seeds.end(), int64_t{total})) {
                                for (int64_t p : {int64_t{total} - 1, int64_t{total}})
                                    if (p > 0 && !std::binary_search(seeds.begin(), seeds.end(), p))
                                        seeds.insert(std::upper_bound(seeds.begin(), seeds.end(), p), p);
                            }
                            if (split & (Mask{1} << s))
                                held.push_back(Held{base + s, t.gpu[s], t.cpu[s], t.disk[s], total});
                            else
                                held.push_back(Held{base + s, total, total, total, total});
                        }
                    }
                }
                std::vector<Held> out;
                b.pick(held, k, cap, also, out);
                py::list res(out.size());
                for (size_t i = 0; i < out.size(); ++i) {
                    const Held& h = out[i];
                    res[i] = py::make_tuple(h.slot, h.gpu, h.cpu, h.disk, h.total);
                }
                return res;
            },
            py::arg("cores"), py::arg("hashes"), py::arg("speculative"), py::arg("now"),
            py::arg("k"), py::arg("cap"), py::arg("also") = std::vector<int>{},
            "Match ``hashes`` in every group's core (group g's slot s is board slot\n"
            "g * 64 + s) and keep the candidates that can win: per hit class and among the\n"
            "targets holding nothing, the k least loaded in each of two orders (requests then\n"
            "tokens; tokens then requests) and the tie at the k-th key (whole\n"
            "when at most ``cap`` more, else sampled), and the ``also`` slots whatever their\n"
            "load. [(slot, gpu, cpu, disk, total)].");

    m.def(
        "out_of_sync_groups",
        [](py::list cores) {
            py::list out;
            int g = 0;
            for (py::handle h : cores) {
                Core& c = h.cast<Core&>();
                Mask mask = 0;
                {
                    Core::Lock l(c.mu);
                    for (int s = 0; s < MAX_SLOTS; ++s)
                        if (!c.seq[static_cast<size_t>(s)].in_sync) mask |= Mask{1} << s;
                }
                if (mask) out.append(py::make_tuple(g, mask));
                ++g;
            }
            return out;
        },
        py::arg("cores"),
        "``Core.out_of_sync`` of every core in one call: [(position in ``cores``, mask)] for\n"
        "those with a slot out of sync (a wide pool's 16 groups asked one by one cost ~4 us\n"
        "a request).");

    py::class_<LiveFeed>(m, "EventReader")
        .def(py::init([](const std::vector<std::pair<std::string, int>>& servers,
                         const std::string& subject, const std::string& prefix,
                         const std::string& user, const std::string& password,
                         const std::string& token, const std::string& name,
                         double connect_timeout, double ping_interval, size_t max_control,
                         size_t max_payload, size_t max_queued, size_t max_queued_bytes) {
                 if (servers.empty()) throw py::value_error("the event reader needs a server");
                 for (const auto& [h, port] : servers)
                     if (h.empty() || port <= 0 || port > 65535)
                         throw py::value_error("a server is (host, port 1..65535)");
                 if (subject.empty() || subject.find_first_of(" \t\r\n") != std::string::npos)
                     throw py::value_error("the subject must be one NATS subject");
                 if (!(connect_timeout > 0 && connect_timeout <= 600) ||
                     !(ping_interval > 0 && ping_interval <= 600))
                     throw py::value_error("timeouts must be in (0, 600] seconds");
                 if (max_control < 256 || max_payload < 1 || max_payload > (1u << 30) ||
                     max_queued < 1 || max_queued_bytes < max_payload)
                     throw py::value_error("the reader's bounds are out of range");
                 NatsOptions o;
                 o.servers = servers;
                 o.subject = subject;
                 o.user = user, o.password = password, o.token = token, o.name = name;
                 o.connect_timeout_ms = static_cast<int>(connect_timeout * 1000);
                 o.ping_interval_ms = static_cast<int>(ping_interval * 1000);
                 o.max_control = max_control;
                 o.max_payload = max_payload;
                 return std::make_unique<LiveFeed>(std::move(o), prefix, max_queued,
                                                   max_queued_bytes);
             }),
             py::arg("servers"), py::arg("subject"), py::arg("prefix"), py::arg("user"),
             py::arg("password"), py::arg("token"), py::arg("name"),
             py::arg("connect_timeout"), py::arg("ping_interval"), py::arg("max_control"),
             py::arg("max_payload"), py::arg("max_queued"), py::arg("max_queued_bytes"))
        .def("start", &LiveFeed::start)
        .def("close",
             [](LiveFeed& f) {
                 py::gil_scoped_release nogil;
                 f.stop();
             })
        .def_property_readonly("wake_fd", &LiveFeed::wake_fd)
        .def_property_readonly("up", [](LiveFeed& f) { return f.up.load(); })
        .def(
            "route",
            [](LiveFeed& f, const std::string& worker, Core& core, int slot, py::object rank,
               int64_t quota) {
                check_slot(slot);
                const int64_t r = rank_of(rank);
                py::gil_scoped_release nogil;
                f.route(worker, &core, slot, r, quota);
            },
            py::arg("worker"), py::arg("core"), py::arg("slot"), py::arg("rank"),
            py::arg("quota"),
            "Apply ``worker``'s plain in-order live batches here (the caller keeps ``core``\n"
            "alive while routed).")
        .def(
            "unroute",
            [](LiveFeed& f, const std::string& worker) {
                py::gil_scoped_release nogil;
                f.unroute(worker);
            },
            py::arg("worker"))
        .def(
            "poll",
            [](LiveFeed& f, size_t max) {
                std::vector<LiveFeed::Record> recs;
                std::vector<std::string> dropped;
                std::vector<std::tuple<std::string, int64_t, int64_t>> applied;
                bool all = false, more = false;
                {
                    py::gil_scoped_release nogil;
                    f.take(max, recs, dropped, all, applied, more);
                }
                py::list out;
                std::vector<std::pair<std::string_view, std::string_view>> kv;
                for (auto& rec : recs) {
                    if (rec.kind == LiveFeed::MESSAGE) {
                        py::object subject = py::reinterpret_steal<py::object>(
                            PyUnicode_DecodeUTF8(rec.subject.data(),
                                                 static_cast<Py_ssize_t>(rec.subject.size()),
                                                 "replace"));
                        py::object headers = py::none();
                        std::string_view status;
                        if (!rec.headers.empty()) {
                            py::dict h;
                            if (parse_headers(rec.headers, status, kv)) {
                                for (const auto& [k, v] : kv)
                                    h[py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(
                                        k.data(), static_cast<Py_ssize_t>(k.size()), "replace"))] =
                                        py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(
                                            v.data(), static_cast<Py_ssize_t>(v.size()),
                                            "replace"));
                                if (!status.empty()) h["Status"] = std::string(status);
                            }
                            headers = h;
                        }
                        out.append(py::make_tuple(0, subject, headers, py::bytes(rec.payload)));
                    } else if (rec.kind == LiveFeed::NOTED) {
                        py::object epoch = rec.epoch.has ? py::object(py::str(rec.epoch.text))
                                                         : py::object(py::none());
                        out.append(py::make_tuple(1, rec.worker, rec.seq, rank_obj(rec.rank),
                                                  epoch, py::bytes(rec.payload),
                                                  outcome(rec.d, rec.r, &rec.flags)));
                    } else {
                        out.append(py::make_tuple(rec.kind, rec.text));
                    }
                }
                return py::make_tuple(out, dropped, all, applied, more);
            },
            py::arg("max"),
            "(records, workers with dropped messages, all dropped, (worker, batches, events)\n"
            "applied here since the last poll, more records waiting).")
        .def("lag",
             [](LiveFeed& f) {
                 py::gil_scoped_release nogil;
                 return f.lag();
             })
        .def("stats", [](LiveFeed& f) {
            py::dict d;
            d["messages"] = f.messages.load();
            d["applied"] = f.applied_here.load();
            d["dropped"] = f.queue_full.load();
            d["oversized"] = f.oversized.load();
            d["failed"] = f.failed.load();
            return d;
        });
}
