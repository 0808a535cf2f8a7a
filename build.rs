//! Sets `kvrs_avx512` where the compiler has the AVX-512 intrinsics (stable since Rust
//! 1.89; the crate builds from 1.88, where the write loops keep to AVX2). With the
//! `cuda-sim` feature, compiles the CUDA kernels for the host (the simulated device that
//! tests the CUDA backend without a GPU).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(kvrs_avx512)");
    if rustc_minor().is_some_and(|minor| minor >= 89) {
        println!("cargo:rustc-cfg=kvrs_avx512");
    }
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

/// The minor version of the compiler Cargo runs (`1.89.0` gives 89), if it says.
fn rustc_minor() -> Option<u32> {
    let rustc = std::env::var_os("RUSTC")?;
    let out = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()?;
    let version = String::from_utf8(out.stdout).ok()?;
    // "rustc 1.95.0 (59807616e 2026-04-14)"
    let mut parts = version.split_whitespace().nth(1)?.split('.');
    match (parts.next()?, parts.next()?) {
        ("1", minor) => minor.parse().ok(),
        _ => None,
    }
}
