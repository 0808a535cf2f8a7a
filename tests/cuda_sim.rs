//! The CUDA backend on the simulated device (`cargo test --features cuda-sim`): the
//! kernels compiled for the host, driven by the same storage code that drives a GPU.
#![cfg(feature = "cuda-sim")]

use kvrs::unstable::cuda::{gpu_for, Args};
use kvrs::unstable::{CacheCore, CacheShape, TensorMut, TensorRef};
use kvrs::{DType, Device, KvError};

fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((seed * 7919 + i * 104_729) % 97) as f32 / 8.0 - 6.0)
        .collect()
}

fn on<'a>(v: &'a [f32], shape: &[usize], device: Device) -> TensorRef<'a> {
    let t = TensorRef::from_f32(v, shape).unwrap();
    t.on(device)
}

/// Keys and values of positions `0..n` of `layer`, read into host float32.
fn contents(c: &CacheCore, layer: i64, n: usize) -> (Vec<f32>, Vec<f32>) {
    let s = c.shape();
    let len = s.num_kv_heads * n * s.head_dim;
    let (mut k, mut v) = (vec![0f32; len], vec![0f32; len]);
    let shape = [s.num_kv_heads, n, s.head_dim];
    let mut tk = TensorMut::from_f32_mut(&mut k, &shape).unwrap();
    let mut tv = TensorMut::from_f32_mut(&mut v, &shape).unwrap();
    c.extract_block(layer, 0, n as i64, &mut tk, &mut tv)
        .unwrap();
    (k, v)
}

#[test]
fn every_kernel_in_the_ptx_is_simulated() {
    let gpu = gpu_for(0).unwrap();
    let ptx = include_str!("../kernels/kvrs.ptx");
    let names: Vec<&str> = ptx
        .lines()
        .filter_map(|l| l.strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap())
        .collect();
    assert!(names.len() > 30, "{names:?}");
    for name in names {
        // An empty grid runs nothing but finds the kernel.
        unsafe { gpu.launch(name, [0, 1, 1], [1, 1, 1], &Args::new(), 0) }
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(unsafe { gpu.launch("kvrs_nope", [0, 1, 1], [1, 1, 1], &Args::new(), 0) }.is_err());
}

/// A decode loop as a CUDA graph would replay it: per step, every layer appends at the
/// device counter, then the counter moves; the host learns the length only at the end.
#[test]
fn captured_decode_loop_equals_host_appends() {
    let (layers, heads, dim, max) = (3, 2, 5, 16);
    let shape = CacheShape {
        num_layers: layers,
        num_kv_heads: heads,
        head_dim: dim,
        v_head_dim: dim,
        max_seq_len: max,
    };
    for dtype in DType::ALL {
        let mut gpu = CacheCore::new(shape, dtype, Device::Cuda(0)).unwrap();
        let mut host = CacheCore::new(shape, dtype, Device::Cpu).unwrap();
        // A prefill through the ordinary path first.
        let pre = values(1, 4 * heads * dim);
        for l in 0..layers as i64 {
            let t = on(&pre, &[4, heads, dim], Device::Cuda(0));
            gpu.append(l, &t, &t).unwrap();
            let t = on(&pre, &[4, heads, dim], Device::Cpu);
            host.append(l, &t, &t).unwrap();
        }
        gpu.advance(4).unwrap();
        host.advance(4).unwrap();
        assert_ne!(gpu.gpu_counter_ptr().unwrap(), 0);
        for step in 0..6 {
            for l in 0..layers {
                let k = values(10 * step + l, heads * dim);
                let v = values(100 + 10 * step + l, heads * dim);
                gpu.append_at_counter(
                    l as i64,
                    &on(&k, &[1, heads, dim], Device::Cuda(0)),
                    &on(&v, &[1, heads, dim], Device::Cuda(0)),
                )
                .unwrap();
                host.append(
                    l as i64,
                    &on(&k, &[1, heads, dim], Device::Cpu),
                    &on(&v, &[1, heads, dim], Device::Cpu),
                )
                .unwrap();
            }
            gpu.advance_counter(1).unwrap();
            host.advance(1).unwrap();
        }
        assert_eq!(gpu.seq_len(), 4, "the host length moves only at the sync");
        assert_eq!(gpu.sync_counter_from_gpu().unwrap(), 10);
        assert_eq!(gpu.seq_len(), host.seq_len());
        for l in 0..layers as i64 {
            assert_eq!(
                contents(&gpu, l, 10),
                contents(&host, l, 10),
                "{dtype} layer {l}"
            );
        }
    }
}

#[test]
fn counter_past_capacity_is_cache_full_and_changes_nothing() {
    let shape = CacheShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 4,
        v_head_dim: 4,
        max_seq_len: 2,
    };
    let mut c = CacheCore::new(shape, DType::F32, Device::Cuda(0)).unwrap();
    c.gpu_counter_ptr().unwrap();
    let k = values(3, 4);
    for _ in 0..3 {
        c.append_at_counter(
            0,
            &on(&k, &[1, 1, 4], Device::Cuda(0)),
            &on(&k, &[1, 1, 4], Device::Cuda(0)),
        )
        .unwrap();
        c.advance_counter(1).unwrap();
    }
    assert!(matches!(
        c.sync_counter_from_gpu(),
        Err(KvError::CacheFull { .. })
    ));
    assert_eq!(c.seq_len(), 0);
    assert!(matches!(
        c.advance_counter(-1),
        Err(KvError::InvalidArgument { name: "n", .. })
    ));
}

#[test]
fn counter_methods_need_a_cuda_cache() {
    let shape = CacheShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 4,
        v_head_dim: 4,
        max_seq_len: 2,
    };
    let c = CacheCore::new(shape, DType::F32, Device::Cpu).unwrap();
    assert!(matches!(c.gpu_counter_ptr(), Err(KvError::NotSupported(_))));
}

#[test]
fn a_host_cache_refuses_device_tensors() {
    let shape = CacheShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 4,
        v_head_dim: 4,
        max_seq_len: 2,
    };
    let mut c = CacheCore::new(shape, DType::F32, Device::Cpu).unwrap();
    let k = values(3, 4);
    let t = on(&k, &[1, 1, 4], Device::Cuda(0));
    assert!(matches!(c.append(0, &t, &t), Err(KvError::Device(_))));
}

#[test]
fn a_refused_store_changes_nothing() {
    use kvrs::Kv;
    let shape = CacheShape {
        num_layers: 1,
        num_kv_heads: 2,
        head_dim: 4,
        v_head_dim: 4,
        max_seq_len: 4,
    };
    let mut c = CacheCore::new(shape, DType::F32, Device::Cuda(0)).unwrap();
    let k = values(5, 3 * 2 * 4);
    let t = on(&k, &[3, 2, 4], Device::Cuda(0));
    c.append(0, &t, &t).unwrap();
    c.advance(3).unwrap();
    c.truncate(0).unwrap(); // the old K/V stay in storage, past the layer's length
    let before = contents(&c, 0, 4);
    let other = values(6, 4);
    let refused = c.store(Kv::Key, 0, 1, 2, &on(&other, &[4], Device::Cuda(1)));
    assert!(matches!(refused, Err(KvError::Device(_))), "{refused:?}");
    assert_eq!(c.layer_len(0), 0);
    assert_eq!(contents(&c, 0, 4), before);
}

/// The paged attention kernel on the simulated device against the CPU core on the same
/// pool contents: ragged batches of three sequences (one forked), full and sliding
/// layers, NHD and HND, GQA, soft-capping, sinks and ALiBi, every dtype; histories
/// short enough for one thread and long enough to be split.
#[test]
fn paged_attention_kernel_equals_the_cpu_core() {
    use half::{bf16, f16};
    use kvrs::unstable::PoolCore;
    use kvrs::{Attention, AttnOptions, KvLayout, LayerKind, PagedShape};

    let (h, hq, d) = (2, 8, 16);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for layout in [KvLayout::Nhd, KvLayout::Hnd] {
            let shape = PagedShape {
                num_layers: 2,
                num_kv_heads: h,
                head_dim: d,
                v_head_dim: d,
                block_size: 4,
                num_blocks: 256,
                layout,
            };
            let attention = Attention {
                kinds: vec![LayerKind::Full, LayerKind::Sliding],
                sliding_window: Some(5),
                chunk_size: None,
                swa_memory: 0,
            };
            let mut pools: Vec<PoolCore> = [Device::Cpu, Device::Cuda(0)]
                .into_iter()
                .map(|dev| {
                    PoolCore::with_attention(shape, attention.clone(), dtype, dev, None).unwrap()
                })
                .collect();
            let mut outs = Vec::new();
            for pool in &mut pools {
                let dev = pool.device();
                let mut ids = Vec::new();
                // 150 positions: split across threads and merged (flash-decoding).
                for (i, n) in [7usize, 0, 150].into_iter().enumerate() {
                    let id = pool.new_sequence();
                    for layer in 0..2 {
                        let (k, v) = (
                            values(10 * i + layer, n * h * d),
                            values(10 * i + layer + 5, n * h * d),
                        );
                        pool.append(
                            id,
                            layer as i64,
                            &on(&k, &[n, h, d], dev),
                            &on(&v, &[n, h, d], dev),
                        )
                        .unwrap();
                    }
                    pool.advance(id, n as i64, None).unwrap();
                    ids.push(id);
                }
                ids.push(pool.fork(ids[2]).unwrap());
                let batch = [
                    ids[0], ids[1], ids[1], ids[2], ids[3], ids[3], ids[3], ids[0],
                ];
                let plan = pool.start_forward(&batch, None, None).unwrap();
                let n = batch.len();
                let q32 = values(99, n * hq * d);
                // q in the pool's dtype (the CUDA kernel's contract), and the output.
                let mut q_bytes = vec![0u8; n * hq * d * dtype.size()];
                let mut out_bytes = vec![0u8; n * hq * d * dtype.size()];
                unsafe {
                    kvrs::unstable::convert_contiguous(
                        q_bytes.as_mut_ptr(),
                        dtype,
                        q32.as_ptr() as *const u8,
                        DType::F32,
                        q32.len(),
                    );
                }
                let q = TensorRef::from_bytes(&q_bytes, dtype, &[n, hq, d])
                    .unwrap()
                    .on(dev);
                let sinks = values(7, hq);
                let slopes: Vec<f32> = (0..hq).map(|i| 0.05 * i as f32).collect();
                let opts = AttnOptions {
                    softcap: Some(3.0),
                    sinks: Some(&sinks),
                    alibi_slopes: Some(&slopes),
                    ..Default::default()
                };
                let mut per_layer = Vec::new();
                for layer in 0..2 {
                    let (k, v) = (values(50 + layer, n * h * d), values(60 + layer, n * h * d));
                    pool.write(
                        layer as i64,
                        &on(&k, &[n, h, d], dev),
                        &on(&v, &[n, h, d], dev),
                        plan.group_slots(pool.group_for(Some(layer as i64)).unwrap()),
                    )
                    .unwrap();
                    let mut out = TensorMut::from_bytes_mut(&mut out_bytes, dtype, &[n, hq, d])
                        .unwrap()
                        .on(dev);
                    pool.forward_attention(&plan, layer as i64, &q, &mut out, &opts)
                        .unwrap();
                    let got: Vec<f32> = match dtype {
                        DType::F32 => out_bytes
                            .chunks(4)
                            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                            .collect(),
                        DType::F16 => out_bytes
                            .chunks(2)
                            .map(|b| f16::from_le_bytes(b.try_into().unwrap()).to_f32())
                            .collect(),
                        DType::BF16 => out_bytes
                            .chunks(2)
                            .map(|b| bf16::from_le_bytes(b.try_into().unwrap()).to_f32())
                            .collect(),
                        other => unreachable!("{other} is not a device dtype"),
                    };
                    per_layer.push(got);
                }
                pool.finish_forward(&plan).unwrap();
                outs.push(per_layer);
            }
            let tol = match dtype {
                DType::F32 => 1e-5,
                DType::F16 => 2e-3,
                DType::BF16 => 1.6e-2,
                other => unreachable!("{other} is not a device dtype"),
            };
            for (layer, (cpu, dev)) in outs[0].iter().zip(&outs[1]).enumerate() {
                for (i, (a, b)) in cpu.iter().zip(dev).enumerate() {
                    assert!(
                        (a - b).abs() <= tol * (1.0 + a.abs()),
                        "{dtype} {layout} layer {layer} elem {i}: cpu {a} vs device {b}"
                    );
                }
                assert!(cpu.iter().any(|&x| x != 0.0));
            }
        }
    }
}

/// A small paged shape on the simulated device, and a storage for one cache tensor of it.
fn paged_storage() -> (
    kvrs::unstable::PagedTensor,
    Box<dyn kvrs::unstable::Storage>,
) {
    let shape = kvrs::PagedShape {
        num_layers: 1,
        num_kv_heads: 2,
        head_dim: 4,
        v_head_dim: 4,
        block_size: 4,
        num_blocks: 2,
        layout: kvrs::KvLayout::Nhd,
    };
    let s = kvrs::unstable::allocate(Device::Cuda(0), DType::F32, shape.layer_elems(), 4).unwrap();
    (kvrs::unstable::PagedTensor { shape, index: 0 }, s)
}

#[test]
#[should_panic(expected = "is not one of the 2 blocks")]
fn scatter_refuses_slots_outside_the_storage() {
    let (t, mut s) = paged_storage();
    let k = vec![0f32; 8];
    let k = on(&k, &[1, 2, 4], Device::Cuda(0));
    // Slot 8 is block 2 of a pool of 2: the kernel would write past the storage.
    let _ = s.write_slots(t, &[8], &k, &k);
}

#[test]
#[should_panic(expected = "exceed storage")]
fn gather_refuses_cache_tensors_outside_the_storage() {
    let (mut t, s) = paged_storage();
    t.index = 1;
    let (mut k, mut v) = (vec![0f32; 8], vec![0f32; 8]);
    let mut ko = TensorMut::from_f32_mut(&mut k, &[2, 1, 4])
        .unwrap()
        .on(Device::Cuda(0));
    let mut vo = TensorMut::from_f32_mut(&mut v, &[2, 1, 4])
        .unwrap()
        .on(Device::Cuda(0));
    let _ = s.read_positions(t, &[0], 0, 1, &mut ko, &mut vo);
}

#[test]
fn device_scaling_refuses_scales_that_do_not_match_the_tensor() {
    let (_, s) = paged_storage();
    let scaler = s.scaler().unwrap();
    let mut x = vec![1f32; 16];
    let mut t = TensorMut::from_f32_mut(&mut x, &[2, 2, 4])
        .unwrap()
        .on(Device::Cuda(0));
    let e = scaler.multiply(&mut t, 1, &[2.0, 2.0, 2.0]).unwrap_err();
    assert!(matches!(e, KvError::Shape { .. }), "{e}");
    assert!(scaler.multiply(&mut t, 3, &[2.0, 2.0]).is_err());
    scaler.multiply(&mut t, 1, &[2.0, 3.0]).unwrap();
    let mut host = vec![1f32; 16];
    let mut h = TensorMut::from_f32_mut(&mut host, &[2, 2, 4]).unwrap();
    let e = scaler.multiply(&mut h, 1, &[2.0, 3.0]).unwrap_err();
    assert!(matches!(e, KvError::Device(_)), "{e}");
    s.as_cuda()
        .unwrap()
        .gpu()
        .synchronize(s.as_cuda().unwrap().stream())
        .unwrap();
    let row = |j: usize| [2.0, 3.0][j % 2];
    assert!((0..16).all(|i| x[i] == row(i / 4)), "{x:?}");
}
