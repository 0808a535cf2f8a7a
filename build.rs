//! With the `cuda-sim` feature, compiles the CUDA kernels for the host (the simulated
//! device that tests the CUDA backend without a GPU). Otherwise does nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA_SIM").is_none() {
        return;
    }
    for f in [
        "kernels/kvrs.cu",
        "kernels/tensor_core.cuh",
        "kernels/attention_mma.cuh",
        "kernels/attention_mla.cuh",
        "kernels/sim/sim.cpp",
        "kernels/sim/fiber.h",
        "kernels/sim/scheduler.h",
        "kernels/sim/cooperative.h",
        "kernels/sim/tensor_core.h",
        "kernels/sim/test_kernels.cu",
        "kernels/sim/cuda_fp16.h",
        "kernels/sim/cuda_bf16.h",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    #[cfg(feature = "cuda-sim")]
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .include("kernels/sim")
        .file("kernels/sim/sim.cpp")
        .warnings(true)
        // The kernels' `#pragma unroll` is nvcc's; the host compiler unrolls as it sees fit.
        .flag_if_supported("-Wno-unknown-pragmas")
        .compile("kvrs_sim");
}
