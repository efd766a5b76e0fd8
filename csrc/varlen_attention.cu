// Binding of the paged variable-length verify attention.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops.h"
#include "varlen_attention.cuh"

namespace dspark {
namespace {

template <typename T, int D>
void run(const at::Tensor& q, const at::Tensor& marker, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& page_table, at::Tensor& out, double scale, int64_t num_splits) {
  attn::Params<T> p{};
  p.q = static_cast<const T*>(q.data_ptr());
  p.marker = marker.data_ptr<int>();
  p.k_cache = static_cast<const T*>(k_cache.data_ptr());
  p.v_cache = static_cast<const T*>(v_cache.data_ptr());
  p.page_table = page_table.data_ptr<int>();
  p.out = static_cast<T*>(out.data_ptr());
  p.k_stride_page = k_cache.stride(0);
  p.k_stride_token = k_cache.stride(1);
  p.k_stride_head = k_cache.stride(2);
  p.v_stride_page = v_cache.stride(0);
  p.v_stride_token = v_cache.stride(1);
  p.v_stride_head = v_cache.stride(2);
  p.num_tokens = static_cast<int>(q.size(0));
  p.hq = static_cast<int>(q.size(1));
  p.hkv = static_cast<int>(k_cache.size(2));
  p.group = p.hq / p.hkv;
  p.tokens_per_tile = attn::tokens_per_tile(p.group);
  p.num_pages = static_cast<int>(k_cache.size(0));
  p.page_size = static_cast<int>(k_cache.size(1));
  p.num_slots = static_cast<int>(page_table.size(0));
  p.max_pages = static_cast<int>(page_table.size(1));
  p.scale_log2 = static_cast<float>(scale) * attn::kLog2e;
  const int tiles = ceil_div(p.num_tokens, p.tokens_per_tile);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.device().index()));
  p.splits = num_splits > 0 ? static_cast<int>(num_splits)
                            : attn::auto_splits(tiles, p.hkv, p.max_pages * p.page_size, sms);
  at::Tensor part_o, part_lse;
  if (p.splits > 1) {
    part_o = at::empty({p.splits, p.num_tokens, p.hq, D}, q.options().dtype(at::kFloat));
    part_lse = at::empty({p.splits, p.num_tokens, p.hq}, q.options().dtype(at::kFloat));
    p.part_o = part_o.data_ptr<float>();
    p.part_lse = part_lse.data_ptr<float>();
  }
  C10_CUDA_CHECK((attn::launch<T, D>(p, c10::cuda::getCurrentCUDAStream())));
}

void check_cache(const at::Tensor& c, const char* name, const at::Device& device, at::ScalarType dtype,
                 int64_t hkv, int64_t D) {
  TORCH_CHECK(c.device() == device && c.scalar_type() == dtype, name, " must be ", dtype, " on ", device);
  TORCH_CHECK(c.dim() == 4 && c.size(2) == hkv && c.size(3) == D, name,
              " must be [num_pages, page_size, Hkv, D] with Hkv=", hkv, " D=", D, ", got ", c.sizes());
  TORCH_CHECK(c.stride(3) == 1 && c.stride(0) % 8 == 0 && c.stride(1) % 8 == 0 && c.stride(2) % 8 == 0,
              name, " needs a contiguous last dim and strides divisible by 8");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

}  // namespace

void varlen_attention(const at::Tensor& q, const at::Tensor& marker, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& page_table, at::Tensor& out,
                      double scale, int64_t num_splits) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 3, "q must be a CUDA [T, Hq, D] tensor");
  const at::Device device = q.device();
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "q must be float16 or bfloat16, got ", dtype);
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head dim must be 64 or 128, got ", D);
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_pages, page_size, Hkv, D]");
  const int64_t hkv = k_cache.size(2);
  TORCH_CHECK(hkv > 0 && hq > 0 && hq % hkv == 0 && hq / hkv <= attn::kBlockM,
              "Hq must be a multiple of Hkv with group size <= 64, got Hq=", hq, " Hkv=", hkv);
  check_tensor(q, "q", device, dtype, {T, hq, D});
  check_tensor(out, "out", device, dtype, {T, hq, D});
  // Q and O rows move as 16-byte vectors: a contiguous view at an odd offset would fault.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "q and out must be 16-byte aligned");
  check_tensor(marker, "marker", device, at::kInt, {T, 2});
  check_cache(k_cache, "k_cache", device, dtype, hkv, D);
  check_cache(v_cache, "v_cache", device, dtype, hkv, D);
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
              "k_cache and v_cache must have the same pages");
  TORCH_CHECK(page_table.dim() == 2, "page_table must be [num_slots, max_pages]");
  check_tensor(page_table, "page_table", device, at::kInt, {page_table.size(0), page_table.size(1)});
  TORCH_CHECK(num_splits >= 0 && num_splits <= attn::kMaxSplits, "num_splits must be in [0, ", attn::kMaxSplits,
              "] (0 = automatic)");
  TORCH_CHECK(T * hq * D < (int64_t(1) << 31), "too many query elements for one call");

  const c10::cuda::CUDAGuard guard(device);
  if (dtype == at::kHalf) {
    if (D == 64) run<__half, 64>(q, marker, k_cache, v_cache, page_table, out, scale, num_splits);
    else run<__half, 128>(q, marker, k_cache, v_cache, page_table, out, scale, num_splits);
  } else {
    if (D == 64) run<__nv_bfloat16, 64>(q, marker, k_cache, v_cache, page_table, out, scale, num_splits);
    else run<__nv_bfloat16, 128>(q, marker, k_cache, v_cache, page_table, out, scale, num_splits);
  }
}

}  // namespace dspark
