// Explicit instantiations of every kernel and launcher, without torch: the CMake target
// dspark_kernels compiles this file as a quick check of the device code.
#include "markov_sample.cuh"
#include "philox.cuh"
#include "varlen_attention.cuh"

namespace dspark {
namespace markov {
template cudaError_t launch<float>(Params<float>, void*, LaunchMode, cudaStream_t);
template cudaError_t launch<__half>(Params<__half>, void*, LaunchMode, cudaStream_t);
template cudaError_t launch<__nv_bfloat16>(Params<__nv_bfloat16>, void*, LaunchMode, cudaStream_t);
}  // namespace markov
namespace attn {
template cudaError_t launch<__half, 64>(const Params<__half>&, cudaStream_t);
template cudaError_t launch<__half, 128>(const Params<__half>&, cudaStream_t);
template cudaError_t launch<__nv_bfloat16, 64>(const Params<__nv_bfloat16>&, cudaStream_t);
template cudaError_t launch<__nv_bfloat16, 128>(const Params<__nv_bfloat16>&, cudaStream_t);
}  // namespace attn
}  // namespace dspark
