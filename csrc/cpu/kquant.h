// GGUF K-quant weights (Q4_K, Q5_K, Q6_K; Q8_0, Q4_0 and Q4_1 alike) kept as the file's super-blocks, and their decode matmul with
// int8 activations (llama.cpp's q8_K idea, with a scale per 32 inputs: kquant_kernels.h). Why:
// widening them to our int4 / int8 group formats
// (weights/gguf_quant.py) made a Q4_K_M model 1.21x its file and decode read 1.35 GB a token
// where llama.cpp reads 1.0 (docs/performance.md, issue 18); these read the file's bytes.
//
// Layout: a lossless reordering of the file's bytes (the same bytes, the same count), 16 rows at
// a time ("a pack"), so that a kernel reads one strictly sequential stream and computes 16 output
// rows per pass (rows read side by side from their own places are many short streams, which this
// CPU reads at half the bandwidth). ops/kquant.py builds it (`pack_rows`) and holds its inverse.
// A weight is `parts` stacked along the output rows (a merged q|k|v whose v has another type);
// each part's rows are padded with zero blocks to whole packs. Pack p of a part holds, for each
// super-block b of 256 inputs in order, a block of 16 x the type's bytes (row r = row 16p + r):
//
// Q4_K (16 x 144 = 2304 bytes; w = d * sc[j] * q - dmin * m[j], sub-block j of 32 inputs):
//   d[16], dmin[16]        fp16, row r's at [r]
//   six-bit values [192]   sc[j][r] (value 16j + r) and m[j][r] (value 128 + 16j + r), packed as
//                          Q6_K packs its codes: bytes 0..127 hold the low 4 bits of values
//                          i (low nibble) and 128 + i (high nibble); byte 128 + i holds the high 2
//                          bits of values i, 64 + i, 128 + i, 192 + i in bits 0-1, 2-3, 4-5, 6-7.
//   qs [4][8][16][4]       [p][c][r]: the file's qs bytes 32p + 4c .. 32p + 4c + 3 of row r; their
//                          low nibbles are inputs 64p + 4c + i, the high ones 64p + 32 + 4c + i.
// Q5_K (16 x 176 = 2816 bytes): Q4_K's d, dmin and six-bit values, then
//   qh [8][16][4]          [c][r]: the file's qh bytes 4c .. 4c + 3 of row r (bit s of qh byte l: the
//                          fifth bit of input 32s + l), then Q4_K's qs; code = nibble | bit << 4.
// Q6_K (16 x 210 = 3360 bytes; w = d * sc[s] * (q - 32), sub-block s of 16 inputs):
//   d[16]                  fp16
//   sc [16][16]            int8 [s][r]
//   steps [2][8] x 192     [h][c]: ql bytes 64h + 4c .. +3 of each row (64 bytes, [r][4]), then ql
//                          bytes 64h + 32 + 4c .. (64), then qh bytes 32h + 4c .. (64); with
//                          l = 4c + i the codes are, as in the file, inputs 128h + l (ql low
//                          nibble, qh bits 0-1), + 32 (second ql low nibble, qh bits 2-3), + 64
//                          (first ql high nibble, bits 4-5), + 96 (second high nibble, bits 6-7).
// Both six-bit packings are decoded by one routine (kquant_kernels.h: six_bits).
// Q8_0 (16 x 272 = 4352 bytes: 8 file blocks of 32 inputs a row, w = d[j] * q, q int8):
//   d [8][16]              fp16 [j][r]: block j (inputs 32j .. 32j + 31) of row r
//   qs [64][16][4]         [c][r]: the codes of inputs 4c .. 4c + 3 of row r, each stored as q + 128
//                          (the byte xor 0x80: unsigned, what the integer products take; the kernel
//                          subtracts 128 times the activations' sum per 32)
// Not a K-quant, but the same shape of work (one sequential stream, 16 rows a pass, int8
// products): through the fp32-activation int8 kernel a Q8_0 lm_head read 10 GB/s on one core,
// 15 GB/s with int8 activations (quant_kernels_a8.h), where llama.cpp's whole step ran at ~21.
// Q4_0 (16 x 144 = 2304 bytes: 8 file blocks of 32 inputs, w = d[j] * (q - 8)) and Q4_1 (16 x 160 =
// 2560 bytes, w = d[j] * q + m[j]) the same way, their codes in nibbles:
//   d [8][16]              fp16 [j][r], then (Q4_1) m [8][16] likewise
//   qs [8][4][16][4]       [j][c][r]: the file's qs bytes 4c .. 4c + 3 of block j of row r; their
//                          low nibbles are inputs 32j + 4c + i, the high ones 32j + 16 + 4c + i.
#pragma once

#include <cstdint>

namespace ninfer::cpu {

constexpr std::int64_t kPackRows = 16;
constexpr std::int64_t kSuperBlock = 256;  // inputs per super-block (QK_K)
constexpr int kMaxParts = 8;  // ops/kquant.py MAX_PARTS

enum class BlockType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's type ids

// Bytes of one row's super-block (Q8_0, Q4_0, Q4_1: their 8 blocks of 256 inputs) in the file.
constexpr std::int64_t block_bytes(BlockType t) {
  switch (t) {
    case BlockType::Q4_0: return 8 * 18;
    case BlockType::Q4_1: return 8 * 20;
    case BlockType::Q8_0: return 8 * 34;
    case BlockType::Q4_K: return 144;
    case BlockType::Q5_K: return 176;
    default: return 210;  // Q6_K
  }
}

struct KQuantPart {
  BlockType type;
  std::int64_t rows;  // output rows (the packed data has them rounded up to whole packs)
};

struct KQuantWeight {
  std::uintptr_t data;  // the parts' packs, in order
  std::int64_t k;       // inputs, a multiple of 256
  int parts;
  KQuantPart part[kMaxParts];
};

// out[m][n] = sum_k x[m][k] * w[n][k] (+ bias[n]) with x quantized to int8 per group of 32 inputs
// (scale absmax / 127, round half to even: ops/quant.py quantize_activations_ref) and multiplied
// in integers; the activation scales, d and dmin in fp32.
struct KQuantMatmulArgs {
  KQuantWeight w;
  std::uintptr_t out;   // fp32 [m, n]
  std::uintptr_t x;     // fp32 [m, k]
  std::uintptr_t bias;  // fp32 [n], or 0
  std::int64_t m;
  int threads;  // the caller counts as one
};

void kquant_matmul(const KQuantMatmulArgs& args);

// out fp32 (or bf16) [count, k] = rows [first, first + count) of the dense weight, each value as
// gguf-py computes it in fp32: (d * sc) * q - dmin * m (Q4_K, Q5_K), (d * sc) * (q - 32), d * q.
void kquant_dequantize(const KQuantWeight& w, std::int64_t first, std::int64_t count, std::uintptr_t out, bool bf16,
                       int threads);

}  // namespace ninfer::cpu
