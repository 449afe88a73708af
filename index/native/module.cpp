// Python binding of the native core (index._native). Slot-based and typed at the
// boundary: the Python wrappers (index/native_index.py) own worker names, the clock and
// the result types. Every call that touches the index takes the index's mutex; a call
// that cannot get it at once waits with the GIL released, so the ingest thread (which
// applies a whole batch under the mutex, GIL released) and the request path never
// deadlock and a match never sees half a batch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <string>

#include "events.hpp"
#include "prefix_index.hpp"
#include "xxh3.hpp"

namespace py = pybind11;
using namespace cr;

namespace {

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
        std::memcpy(out.data(), info.ptr, n * 4);
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

class Core {
   public:
    Core(uint64_t max_blocks, int bisect_min)
        : index(max_blocks, bisect_min), decoder({}), applier(index, 16, false, 0) {}

    PrefixCore index;
    EventDecoder decoder;
    EventApplier applier;
    std::mutex mu;

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

PEvent event_from_tuple(const py::tuple& t) {
    PEvent ev;
    const std::string kind = t[0].cast<std::string>();
    if (kind == "cleared") {
        ev.kind = CLEARED;
        return ev;
    }
    ev.tier = t[1].cast<int>();
    ev.other_group = t[2].cast<bool>();
    ev.hashes = u64s(t[3]);
    if (kind == "removed") {
        ev.kind = REMOVED;
        return ev;
    }
    if (kind != "stored") throw py::value_error("event kind must be stored/removed/cleared");
    ev.kind = STORED;
    if (!t[4].is_none()) ev.has_parent = true, ev.parent = t[4].cast<uint64_t>();
    if (t[5].is_none()) {
        ev.bad_tokens = true;  // counted as in Python: the length checks come first
        ev.tokens.resize(t[6].cast<size_t>());
    } else {
        py::buffer_info info;
        std::string_view tb = bytes_of(t[5].cast<py::buffer>(), info);
        ev.tokens.resize(tb.size() / 4);
        std::memcpy(ev.tokens.data(), tb.data(), ev.tokens.size() * 4);
    }
    ev.block_size = t[7].cast<int64_t>();
    if (!t[8].is_none()) ev.has_root = true, ev.root = t[8].cast<uint64_t>();
    if (!t[9].is_none()) {
        for (auto [k, v] : t[9].cast<py::dict>())
            ev.extras.emplace_back(k.cast<int64_t>(), v.cast<std::string>());
    }
    return ev;
}

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
        .def("match",
             [](Core& c, py::handle hashes, bool speculative, double now) {
                 std::vector<uint64_t> hs = u64s(hashes);
                 Depths d;
                 {
                     Core::Lock l(c.mu);
                     c.index.depths(hs.data(), hs.size(), speculative, now, d);
                 }
                 py::list out;
                 for (Mask m = d.found; m; m &= m - 1) {
                     const int s = __builtin_ctzll(m);
                     out.append(py::make_tuple(s, d.depth[s]));
                 }
                 return out;
             })
        .def("match_tiers",
             [](Core& c, py::handle hashes, bool speculative, double now) {
                 std::vector<uint64_t> hs = u64s(hashes);
                 Depths d;
                 TierDepths t;
                 Mask split;
                 {
                     Core::Lock l(c.mu);
                     c.index.depths(hs.data(), hs.size(), speculative, now, d);
                     split = c.index.split_tiers(hs.data(), hs.size(), speculative, d, t);
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
             })
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
        .def("engine_blocks",
             [](Core& c, int slot) {
                 check_slot(slot);
                 py::dict out;
                 Core::Lock l(c.mu);
                 c.applier.worker(slot).blocks.for_each([&](uint64_t eh, BlockRef& ref) {
                     out[py::int_(eh)] = py::int_(ref.router);
                 });
                 return out;
             })
        .def("known_engine",
             [](Core& c, int slot, py::handle engine_hashes) {
                 check_slot(slot);
                 std::vector<uint64_t> hs = u64s(engine_hashes);
                 py::list out;
                 Core::Lock l(c.mu);
                 auto& blocks = c.applier.worker(slot).blocks;
                 for (uint64_t eh : hs) out.append(py::bool_(blocks.find(eh) != nullptr));
                 return out;
             })
        .def("engine_hashes", [](Core& c, int slot, py::handle router_hashes) {
            check_slot(slot);
            std::vector<uint64_t> hs = u64s(router_hashes), out;
            {
                Core::Lock l(c.mu);
                auto& eo = c.applier.worker(slot).engine_of;
                for (uint64_t rh : hs) {
                    const uint64_t* eh = eo.find(rh);
                    if (!eh) break;
                    out.push_back(*eh);
                }
            }
            return to_list(out);
        });
}
