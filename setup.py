"""Builds the native core (index._native) with the rest of the package.

Everything else is declared in pyproject.toml; setup.py exists only because a C++
extension needs pybind11's include path at build time.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "index._native",
            ["index/native/module.cpp"],
            depends=[
                "index/native/xxh3.hpp",
                "index/native/flat_map.hpp",
                "index/native/node_table.hpp",
                "index/native/prefix_index.hpp",
                "index/native/msgpack_reader.hpp",
                "index/native/events.hpp",
                "index/native/seq.hpp",
                "index/native/stack_distance.hpp",
                "index/native/nats_proto.hpp",
                "index/native/nats_reader.hpp",
                "index/native/kv_headers.hpp",
                "index/native/keyed.hpp",
                "index/native/candidates.hpp",
            ],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ],
)
