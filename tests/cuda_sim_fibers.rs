//! The simulated device's cooperative semantics (`cargo test --features cuda-sim`): the
//! test kernels of `kernels/sim/test_kernels.cu`, run as fibers, against references
//! written from CUDA's rules: barriers in loops, shared and dynamic shared memory,
//! shuffles and votes, the group reductions bit for bit, deadlocks and divergent
//! barriers as errors, a missing barrier exposed by another resume order, and the
//! tensor-core instructions (`mma.sync` m16n8k16 and `ldmatrix`) against the PTX ISA's
//! fragment layouts and a plain matrix product.
#![cfg(feature = "cuda-sim")]

use std::ffi::c_int;
use std::marker::PhantomData;
use std::sync::Arc;

use half::{bf16, f16};
use kvrs::unstable::cuda::{gpu_for, Args, DevicePtr, Gpu};
use kvrs::Result;
use proptest::prelude::*;

extern "C" {
    /// Sets the calling thread's resume order: 0 forward, 1 reverse, 2 seeded by
    /// `seed`; -1 returns to `KVRS_SIM_ORDER`.
    fn kvrs_sim_set_order(mode: c_int, seed: u64);
}

/// The resume orders a test runs in: forward, reverse and two seeds.
const ORDERS: [(c_int, u64); 4] = [(0, 0), (1, 0), (2, 1), (2, 2)];

/// Runs `f` with the calling thread's resume order set to `order`.
fn in_order<R>(order: (c_int, u64), f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            // SAFETY: sets a thread-local of the simulator.
            unsafe { kvrs_sim_set_order(-1, 0) }
        }
    }
    // SAFETY: as above.
    unsafe { kvrs_sim_set_order(order.0, order.1) };
    let _reset = Reset;
    f()
}

/// Simulated device memory holding `len` values of `T`, freed on drop.
struct Buf<T: Copy + Default> {
    gpu: Arc<dyn Gpu>,
    ptr: DevicePtr,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Copy + Default> Buf<T> {
    fn zeroed(len: usize) -> Self {
        let gpu = gpu_for(0).unwrap();
        let ptr = gpu.alloc_zeroed(len * size_of::<T>()).unwrap();
        Buf {
            gpu,
            ptr,
            len,
            _t: PhantomData,
        }
    }

    fn from(data: &[T]) -> Self {
        let b = Self::zeroed(data.len());
        // SAFETY: the allocation holds data.len() values.
        unsafe {
            b.gpu
                .htod(b.ptr, data.as_ptr().cast(), size_of_val(data), 0)
                .unwrap()
        };
        b
    }

    fn read(&self) -> Vec<T> {
        let mut out = vec![T::default(); self.len];
        // SAFETY: as above.
        unsafe {
            self.gpu
                .dtoh(
                    out.as_mut_ptr().cast(),
                    self.ptr,
                    self.len * size_of::<T>(),
                    0,
                )
                .unwrap()
        };
        out
    }
}

impl<T: Copy + Default> Drop for Buf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by this device, freed once.
        unsafe { self.gpu.free(self.ptr) }
    }
}

/// Launches a test kernel on the simulated device.
fn launch(name: &str, grid: u32, block: [u32; 3], shared: u32, args: Args) -> Result<()> {
    // SAFETY: every test passes the kernel's parameters, with buffers of the sizes it uses.
    unsafe { gpu_for(0)?.launch_shared(name, [grid, 1, 1], block, shared, &args, 0) }
}

/// The error message of a launch that must fail.
fn failure(name: &str, grid: u32, block: [u32; 3], args: Args) -> String {
    launch(name, grid, block, 0, args)
        .expect_err("the launch fails")
        .to_string()
}

/// kvrs_test_block_sum's result, computed in the kernel's order.
fn block_sum_reference(v: &[f32], b: usize) -> f32 {
    let mut partial: Vec<f32> = (0..b)
        .map(|t| {
            let mut acc = 0.0f32;
            for base in (0..v.len()).step_by(b) {
                acc += v.get(base + (t + 1) % b).copied().unwrap_or(0.0);
            }
            acc
        })
        .collect();
    let mut s = b / 2;
    while s > 0 {
        for t in 0..s {
            partial[t] += partial[t + s];
        }
        s /= 2;
    }
    partial[0]
}

/// The lanes whose values lane `l` reads in `__shfl_sync`, `__shfl_xor_sync`,
/// `__shfl_down_sync` and `__shfl_up_sync` of `width` lanes, by the PTX ISA's
/// definition of `shfl.sync` (CUDA passes c = (32 - width) << 8 | 31, or
/// (32 - width) << 8 for up).
fn shuffle_sources(l: u32, src: i32, lane_mask: i32, delta: u32, width: u32) -> [u32; 4] {
    let segmask = 32 - width;
    let min_lane = l & segmask;
    let max_lane = |c: u32| (l & segmask) | (c & !segmask);
    let pick = |j: i64, valid: bool| if valid { j as u32 } else { l };
    let idx = (min_lane | (src as u32 & 31 & !segmask)) as i64;
    let bfly = (l ^ (lane_mask as u32 & 31)) as i64;
    let down = l as i64 + (delta & 31) as i64;
    let up = l as i64 - (delta & 31) as i64;
    [
        pick(idx, idx <= max_lane(31) as i64),
        pick(bfly, bfly <= max_lane(31) as i64),
        pick(down, down <= max_lane(31) as i64),
        pick(up, up >= max_lane(0) as i64),
    ]
}

/// The xor butterfly over aligned groups of `w` lanes, as a GPU evaluates it.
fn butterfly(x: &[f32], w: usize, op: fn(f32, f32) -> f32) -> Vec<f32> {
    let mut a = x.to_vec();
    let mut m = w / 2;
    while m > 0 {
        a = (0..a.len()).map(|l| op(a[l], a[l ^ m])).collect();
        m /= 2;
    }
    a
}

fn finite() -> impl Strategy<Value = f32> {
    (-1.0e4f32..1.0e4, -20i32..20).prop_map(|(m, e)| m * 2f32.powi(e))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn block_sums_with_barriers_in_loops(
        n in 1usize..700,
        block_log in 0u32..9,
        grid in 1usize..4,
        seed in any::<u64>(),
    ) {
        let b = 1usize << block_log;
        let v: Vec<f32> = (0..grid * n)
            .map(|i| ((i as u64 ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as f32 / 1024.0 - 8000.0)
            .collect();
        let input = Buf::from(&v);
        let out = Buf::<f32>::zeroed(grid);
        for order in ORDERS {
            in_order(order, || {
                let args = Args::new().u64(input.ptr).u64(out.ptr).i32(n as i32);
                launch("kvrs_test_block_sum", grid as u32, [b as u32, 1, 1], 0, args)
            })
            .unwrap();
            let got = out.read();
            for (k, g) in got.iter().enumerate() {
                let want = block_sum_reference(&v[k * n..(k + 1) * n], b);
                prop_assert_eq!(g.to_bits(), want.to_bits(), "block {} in order {:?}", k, order);
            }
        }
    }

    #[test]
    fn shuffles_follow_cudas_rules(
        src in -40i32..70,
        lane_mask in prop::sample::select(vec![0i32, 1, 3, 8, 16, 31, 40, -1]),
        delta in prop::sample::select(vec![0u32, 1, 2, 5, 16, 31, 32, 40, u32::MAX]),
        width_log in 0u32..6,
        shape in prop::sample::select(vec![[32u32, 1, 1], [64, 1, 1], [16, 2, 2], [8, 4, 3]]),
    ) {
        let width = 1u32 << width_log;
        let threads = (shape[0] * shape[1] * shape[2]) as usize;
        let grid = 2usize;
        let v: Vec<i32> = (0..grid * threads).map(|i| i as i32 * 7 + 3).collect();
        let input = Buf::from(&v);
        let out = Buf::<i32>::zeroed(4 * v.len());
        let args = Args::new()
            .u64(input.ptr)
            .u64(out.ptr)
            .i32(src)
            .i32(lane_mask)
            .i32(delta as i32)
            .i32(width as i32);
        launch("kvrs_test_shuffles", grid as u32, shape, 0, args).unwrap();
        let got = out.read();
        for i in 0..v.len() {
            let warp = i / 32 * 32;
            let sources = shuffle_sources((i % 32) as u32, src, lane_mask, delta, width);
            for (k, s) in sources.iter().enumerate() {
                prop_assert_eq!(got[4 * i + k], v[warp + *s as usize], "thread {} shuffle {}", i, k);
            }
        }
    }

    #[test]
    fn votes_follow_cudas_rules(
        preds in prop::collection::vec(prop::bool::weighted(0.9), 96),
        threads in 1usize..97,
    ) {
        // A partial last warp: its missing lanes take no part (as threads that exited).
        let preds = &preds[..threads];
        let v: Vec<i32> = preds.iter().map(|&p| p as i32 * 5).collect();
        let input = Buf::from(&v);
        let out = Buf::<u32>::zeroed(4 * v.len());
        let args = Args::new().u64(input.ptr).u64(out.ptr);
        launch("kvrs_test_votes", 1, [threads as u32, 1, 1], 0, args).unwrap();
        let got = out.read();
        for i in 0..threads {
            let warp = &preds[i / 32 * 32..(i / 32 * 32 + 32).min(threads)];
            let lanes = u32::MAX >> (32 - warp.len());
            let ballot = warp.iter().enumerate().fold(0u32, |b, (l, &p)| b | (p as u32) << l);
            let lower = if i % 32 < 16 { ballot & 0xffff } else { 0 };
            let want = [ballot, (ballot != 0) as u32, (ballot == lanes) as u32, lower];
            prop_assert_eq!(&got[4 * i..4 * i + 4], &want[..], "thread {}", i);
        }
    }

    #[test]
    fn group_reductions_are_the_butterfly_bit_for_bit(
        x in prop::collection::vec(finite(), 64),
        nan_at in prop::option::of(0usize..64),
    ) {
        let mut x = x;
        if let Some(i) = nan_at {
            x[i] = f32::NAN;
        }
        let input = Buf::from(&x);
        let out = Buf::<f32>::zeroed(10 * x.len());
        let out2 = Buf::<f32>::zeroed(5 * x.len());
        let args = Args::new().u64(input.ptr).u64(out.ptr).u64(out2.ptr);
        launch("kvrs_test_group_reductions", 1, [32, 2, 1], 0, args).unwrap();
        let (got, shuffled) = (out.read(), out2.read());
        for (k, w) in [2usize, 4, 8, 16, 32].into_iter().enumerate() {
            let sums = butterfly(&x, w, |a, b| a + b);
            let maxes = butterfly(&x, w, f32::max);
            for i in 0..x.len() {
                prop_assert_eq!(got[10 * i + 2 * k].to_bits(), sums[i].to_bits(), "sum<{}> lane {}", w, i);
                prop_assert_eq!(got[10 * i + 2 * k + 1].to_bits(), maxes[i].to_bits(), "max<{}> lane {}", w, i);
                prop_assert_eq!(shuffled[5 * i + k].to_bits(), sums[i].to_bits(), "shuffled sum<{}> lane {}", w, i);
            }
        }
    }
}

#[test]
fn dynamic_shared_memory_is_per_block() {
    for n in [1u32, 7, 64, 256] {
        let grid = 3u32;
        let v: Vec<u32> = (0..4 * grid * n).collect();
        let input = Buf::from(&v);
        let out = Buf::<u32>::zeroed(v.len());
        let args = Args::new().u64(input.ptr).u64(out.ptr);
        launch("kvrs_test_dynamic_shared", grid, [n, 1, 1], 16 * n, args).unwrap();
        let got = out.read();
        for b in 0..grid {
            for t in 0..n {
                let (o, i) = ((b * n + t) as usize * 4, (b * n + n - 1 - t) as usize * 4);
                assert_eq!(got[o..o + 4], v[i..i + 4], "n {n} block {b} thread {t}");
            }
        }
    }
}

#[test]
fn another_order_exposes_a_missing_barrier() {
    let n = 64usize;
    let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let want: Vec<f32> = (0..n)
        .map(|t| v[t] + v[(t + 1) % n] + v[(t + 2) % n])
        .collect();
    let input = Buf::from(&v);
    let out = Buf::<f32>::zeroed(n);
    let run = |barrier: i32, order| {
        in_order(order, || {
            let args = Args::new().u64(input.ptr).u64(out.ptr).i32(barrier);
            launch("kvrs_test_neighbour_sum", 1, [n as u32, 1, 1], 0, args).unwrap();
            out.read()
        })
    };
    for order in ORDERS {
        assert_eq!(run(1, order), want, "with the barrier, order {order:?}");
    }
    let racy: Vec<Vec<f32>> = ORDERS.iter().map(|&o| run(0, o)).collect();
    assert!(racy.iter().any(|r| *r != racy[0]), "the race shows");
}

#[test]
fn deadlocks_and_divergent_barriers_are_device_errors() {
    let e = failure("kvrs_test_deadlock", 2, [64, 1, 1], Args::new().i32(0));
    assert!(e.contains("(deadlock)"), "{e}");
    assert!(
        e.contains("waits at a warp collective (mask 0xffffffff) for lanes 0xffff0000;"),
        "{e}"
    );
    assert!(
        e.contains("waits at __syncthreads at test_kernels.cu:"),
        "{e}"
    );
    let e = failure("kvrs_test_deadlock", 1, [64, 1, 1], Args::new().i32(1));
    assert!(
        e.contains("(deadlock)") && e.contains("(lanes 0xffff0000 returned)"),
        "{e}"
    );
    let e = failure("kvrs_test_divergent", 1, [64, 1, 1], Args::new().i32(0));
    assert!(
        e.contains("(divergent barrier)") && e.contains("waits at test_kernels.cu:"),
        "{e}"
    );
    let e = failure("kvrs_test_divergent", 1, [64, 1, 1], Args::new().i32(1));
    assert!(
        e.contains("thread (32,0,0) returned while 32 threads wait"),
        "{e}"
    );
    let e = failure("kvrs_test_divergent", 1, [32, 1, 1], Args::new().i32(2));
    assert!(e.contains("call different collectives"), "{e}");
    for order in ORDERS {
        let e = in_order(order, || {
            failure("kvrs_test_divergent", 1, [32, 1, 1], Args::new().i32(3))
        });
        assert!(
            e.contains("(divergent barrier)") && e.contains(" mask 0x0000000"),
            "{e}"
        );
    }
    let e = failure("kvrs_test_divergent", 1, [32, 1, 1], Args::new().i32(4));
    assert!(
        e.contains("(misused cooperation)") && e.contains("does not name its own lane 1"),
        "{e}"
    );
    let e = failure("kvrs_test_plain_barrier", 1, [4, 1, 1], Args::new());
    assert!(
        e.contains("(misused cooperation)") && e.contains("register it with KF"),
        "{e}"
    );
    let e = failure("kvrs_test_deadlock", 1, [1025, 1, 1], Args::new().i32(0));
    assert!(e.contains("(invalid launch)"), "{e}");
    let e = launch(
        "kvrs_test_dynamic_shared",
        1,
        [1, 1, 1],
        300_000,
        Args::new(),
    );
    assert!(e.unwrap_err().to_string().contains("(invalid launch)"));
    // A failed launch leaves nothing behind: the next one runs.
    let one = Buf::from(&[2.0f32]);
    let out = Buf::<f32>::zeroed(1);
    let args = Args::new().u64(one.ptr).u64(out.ptr).i32(1);
    launch("kvrs_test_block_sum", 1, [1, 1, 1], 0, args).unwrap();
    assert_eq!(out.read(), [2.0]);
}

/// 16-bit float bits of `x` (exact: the tests' values are multiples of 1/64 below 4 in
/// magnitude, which both formats hold, so every product and sum of the tile is exact in
/// f64 and the result is rounded once, as the emulation rounds it).
fn bits16(x: f64, bf: bool) -> u16 {
    if bf {
        bf16::from_f64(x).to_bits()
    } else {
        f16::from_f64(x).to_bits()
    }
}

/// `n` values k / 64, |k| < 256, from `seed`.
fn sixty_fourths(seed: u64, n: usize) -> Vec<f64> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) % 511) as f64 / 64.0 - 255.0 / 64.0
        })
        .collect()
}

/// a (16 x 16) times b (16 x 8) plus c, row-major, rounded once to f32.
fn tile_product(a: &[f64], b: &[f64], c: &[f64]) -> Vec<f32> {
    (0..128)
        .map(|e| {
            let (i, j) = (e / 8, e % 8);
            (c[e] + (0..16).map(|k| a[i * 16 + k] * b[k * 8 + j]).sum::<f64>()) as f32
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn mma_follows_the_ptx_fragment_layouts(seed in any::<u64>(), bf in any::<bool>()) {
        let (a, b) = (sixty_fourths(seed, 256), sixty_fourths(seed ^ 1, 128));
        let c: Vec<f64> = sixty_fourths(seed ^ 2, 128).iter().map(|x| x * 9.0).collect();
        let abits: Vec<u16> = a.iter().map(|&x| bits16(x, bf)).collect();
        let bbits: Vec<u16> = b.iter().map(|&x| bits16(x, bf)).collect();
        let c32: Vec<f32> = c.iter().map(|&x| x as f32).collect();
        let (ab, bb, cb, d) = (Buf::from(&abits), Buf::from(&bbits), Buf::from(&c32), Buf::<f32>::zeroed(128));
        let args = Args::new().u64(ab.ptr).u64(bb.ptr).u64(cb.ptr).u64(d.ptr);
        let name = if bf { "kvrs_test_mma_bf16" } else { "kvrs_test_mma_f16" };
        launch(name, 1, [32, 1, 1], 0, args).unwrap();
        prop_assert_eq!(d.read(), tile_product(&a, &b, &c));
    }

    #[test]
    fn ldmatrix_follows_the_ptx_layout(
        seed in any::<u64>(),
        pitch in prop::sample::select(vec![8i32, 16, 24, 64]),
        trans in any::<bool>(),
    ) {
        let m: Vec<u16> = sixty_fourths(seed, 256).iter().map(|&x| bits16(x, false)).collect();
        let (mb, out) = (Buf::from(&m), Buf::<u32>::zeroed(128));
        let args = Args::new().u64(mb.ptr).u64(out.ptr).i32(pitch).i32(trans as i32);
        launch("kvrs_test_ldmatrix", 1, [32, 1, 1], 0, args).unwrap();
        let got = out.read();
        // Lane l, register j: row l / 4, columns 2 (l % 4) and + 1 of matrix j (low half
        // first); transposed: rows 2 (l % 4) and + 1 of column l / 4.
        let at = |j: usize, row: usize, col: usize| m[j * 64 + row * 8 + col] as u32;
        for l in 0..32 {
            for j in 0..4 {
                let (r, c) = (l / 4, 2 * (l % 4));
                let want = if trans {
                    at(j, c, r) | at(j, c + 1, r) << 16
                } else {
                    at(j, r, c) | at(j, r, c + 1) << 16
                };
                prop_assert_eq!(got[4 * l + j], want, "lane {} register {}", l, j);
            }
        }
    }

    #[test]
    fn ldmatrix_feeds_mma_as_the_attention_kernel_does(
        seed in any::<u64>(),
        bf in any::<bool>(),
        trans in any::<bool>(),
    ) {
        let (a, b) = (sixty_fourths(seed, 256), sixty_fourths(seed ^ 3, 128));
        let abits: Vec<u16> = a.iter().map(|&x| bits16(x, bf)).collect();
        let bbits: Vec<u16> = b.iter().map(|&x| bits16(x, bf)).collect();
        let (ab, bb, d) = (Buf::from(&abits), Buf::from(&bbits), Buf::<f32>::zeroed(128));
        let name = if bf { "kvrs_test_ldmatrix_mma_bf16" } else { "kvrs_test_ldmatrix_mma_f16" };
        for order in ORDERS {
            in_order(order, || {
                let args = Args::new().u64(ab.ptr).u64(bb.ptr).u64(d.ptr).i32(trans as i32);
                launch(name, 1, [32, 1, 1], 0, args)
            })
            .unwrap();
            prop_assert_eq!(d.read(), tile_product(&a, &b, &[0.0; 128]), "order {:?}", order);
        }
    }
}

#[test]
fn misused_tensor_core_instructions_are_device_errors() {
    let m = Buf::<u16>::zeroed(256);
    let out = Buf::<u32>::zeroed(128);
    // Rows 8 bytes apart: ldmatrix needs 16-byte aligned rows.
    let args = Args::new().u64(m.ptr).u64(out.ptr).i32(4).i32(0);
    let e = failure("kvrs_test_ldmatrix", 1, [32, 1, 1], args);
    assert!(
        e.contains("(misused cooperation)") && e.contains("not 16-byte aligned"),
        "{e}"
    );
    // Part of a warp.
    let (a, d) = (Buf::<u16>::zeroed(256), Buf::<f32>::zeroed(128));
    let args = Args::new().u64(a.ptr).u64(a.ptr).u64(d.ptr).u64(d.ptr);
    let e = failure("kvrs_test_mma_f16", 1, [16, 1, 1], args);
    assert!(
        e.contains("(misused cooperation)") && e.contains("needs whole warps"),
        "{e}"
    );
}
