// The quant kernels with AVX-512 F / BW / VNNI (16 floats per vector). Compiled with -mavx512f
// -mavx512bw -mavx512vnni -mfma -mf16c; quant_matmul.cpp picks it only where the CPU has all three.
#include "isa_avx512.h"

namespace ninfer::cpu {

const IsaKernels kAvx512Kernels = make_kernels<Avx512>("avx512");

}  // namespace ninfer::cpu
