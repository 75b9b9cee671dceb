// One registration function per kernel family; bindings.cpp calls them all. Each lives in its
// own bind_<family>.cpp beside the family's .cu file, so the families stay independent.
#pragma once

#include <pybind11/pybind11.h>

namespace ninfer {

void bind_quant(pybind11::module_& m);      // bind_quant.cpp: int8 / int4 GEMV
void bind_moe(pybind11::module_& m);        // bind_moe.cpp: routing + fused MoE decode
void bind_gdn(pybind11::module_& m);        // bind_gdn.cpp: fused GDN decode step
void bind_attention(pybind11::module_& m);  // bind_attention.cpp: KV write + split-K decode attention
void bind_sampling(pybind11::module_& m);   // bind_sampling.cpp: top-k / top-p / min-p sampler, penalties
void bind_activation(pybind11::module_& m); // bind_activation.cpp: fused elementwise epilogues

}  // namespace ninfer
