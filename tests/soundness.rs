//! Regression tests of two soundness holes once reachable from safe code: storages that
//! copied a region's shape into (or out of) a caller's tensor without checking the
//! tensor's own shape (a heap overflow in release builds), and destinations written
//! through shared references (a data race). Every storage must refuse a mismatched
//! tensor with a shape error before it copies anything; the compile-time half of the
//! second hole is the `compile_fail` examples on [`kvrs::unstable::TensorMut`]. Runs on
//! the host storages, and on the simulated CUDA device with `--features cuda-sim`.

use kvrs::unstable::{allocate, PagedTensor, PoolCore, Region, TensorMut, TensorRef};
use kvrs::{DType, Device, KvError, KvLayout, PagedShape};

/// The storages' devices under test.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    if cfg!(feature = "cuda-sim") {
        d.push(Device::Cuda(0));
    }
    d
}

/// Where a storage on `device` takes tensors from: host memory always, and its own
/// device (host memory too on the simulated device).
fn tensor_devices(device: Device) -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    if device != Device::Cpu {
        d.push(device);
    }
    d
}

fn is_shape_error<T: std::fmt::Debug>(r: kvrs::Result<T>) -> bool {
    matches!(r, Err(KvError::Shape { .. }))
}

const SENTINEL: f32 = 7.0;

#[test]
fn region_copies_refuse_a_tensor_of_another_shape() {
    let region = Region {
        offset: 0,
        shape: [1, 1, 1024],
        strides: [1024, 1024, 1],
    };
    let ones = vec![1f32; 1024];
    for device in devices() {
        for dtype in [DType::F32, DType::F16, DType::I8] {
            let mut s = allocate(device, dtype, 1024, 4).unwrap();
            for on in tensor_devices(device) {
                let all = TensorRef::from_f32(&ones, &[1, 1, 1024]).unwrap().on(on);
                s.write(region, &all).unwrap();
                let what = format!("{dtype} storage on {device}, tensors on {on}");

                // The reproduction: a 1-element destination, its neighbours after it.
                let mut buf = vec![SENTINEL; 64];
                let mut small = TensorMut::from_f32_mut(&mut buf[..1], &[1]).unwrap().on(on);
                let e = s.read(region, &mut small).unwrap_err();
                assert!(matches!(e, KvError::Shape { .. }), "{what}: {e}");
                assert!(e.to_string().contains("[1, 1, 1024]"), "{what}: {e}");
                assert!(buf.iter().all(|&x| x == SENTINEL), "{what}: written");

                // As many elements, another shape: refused too, untouched.
                let mut buf = vec![SENTINEL; 1024];
                let mut other = TensorMut::from_f32_mut(&mut buf, &[2, 512]).unwrap().on(on);
                assert!(is_shape_error(s.read(region, &mut other)), "{what}");
                assert!(buf.iter().all(|&x| x == SENTINEL), "{what}: written");

                // A 1-element source is refused and the region keeps its values.
                let one = [SENTINEL];
                let small = TensorRef::from_f32(&one, &[1]).unwrap().on(on);
                assert!(is_shape_error(s.write(region, &small)), "{what}");

                // The region's shape without its leading 1s is the same shape.
                let mut flat = TensorMut::from_f32_mut(&mut buf, &[1024]).unwrap().on(on);
                s.read(region, &mut flat).unwrap();
                assert!(
                    buf.iter().all(|&x| (x - 1.0).abs() < 1e-2),
                    "{what}: {buf:?}"
                );
            }
        }
    }
}

#[test]
fn paged_operations_refuse_mismatched_tensors() {
    let (h, d) = (2, 4);
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: h,
        head_dim: d,
        v_head_dim: d,
        block_size: 4,
        num_blocks: 4,
        layout: KvLayout::Nhd,
    };
    let t = PagedTensor { shape, index: 0 };
    let rows = |n: usize| (0..n * h * d).map(|x| x as f32).collect::<Vec<f32>>();
    for device in devices() {
        for dtype in [DType::F32, DType::F16, DType::I8] {
            for on in tensor_devices(device) {
                let mut s = allocate(device, dtype, shape.layer_elems(), d).unwrap();
                let what = format!("{dtype} storage on {device}, tensors on {on}");
                let (two, three) = (rows(2), rows(3));
                let k2 = TensorRef::from_f32(&two, &[2, h, d]).unwrap().on(on);
                let k3 = TensorRef::from_f32(&three, &[3, h, d]).unwrap().on(on);

                // Fewer token rows than slots or positions.
                let r = s.write_slots(t, &[0, 1, 2], &k2, &k2);
                assert!(is_shape_error(r), "{what}");
                assert!(
                    is_shape_error(s.write_positions(t, &[0], 0, &k3, &k2)),
                    "{what}"
                );

                // Nothing was written: the pool still reads as zeros.
                let mut raw = vec![1u8; shape.block_elems() * dtype.size()];
                s.read_blocks(shape, 1, &[0], &mut raw).unwrap();
                assert!(raw.iter().all(|&b| b == 0), "{what}: written");

                // Outputs too small for the positions read are refused, untouched.
                s.write_slots(t, &[0, 1, 2], &k3, &k3).unwrap();
                let mut buf = vec![SENTINEL; 64];
                let mut k_out = TensorMut::from_f32_mut(&mut buf[..h * 2 * d], &[h, 2, d])
                    .unwrap()
                    .on(on);
                let mut other = vec![SENTINEL; h * 3 * d];
                let mut v_out = TensorMut::from_f32_mut(&mut other, &[h, 3, d])
                    .unwrap()
                    .on(on);
                let r = s.read_positions(t, &[0], 0, 3, &mut k_out, &mut v_out);
                assert!(is_shape_error(r), "{what}");
                assert!(buf.iter().chain(&other).all(|&x| x == SENTINEL), "{what}");

                // The block swaps check their buffers' sizes.
                let mut short = vec![0u8; raw.len() - 1];
                assert!(
                    is_shape_error(s.read_blocks(shape, 1, &[0], &mut short)),
                    "{what}"
                );
                let r = s.write_blocks(shape, 1, &[0, 1], &[&raw]);
                assert!(is_shape_error(r), "{what}");
                let r = s.write_blocks(shape, 1, &[0], &[&short]);
                assert!(is_shape_error(r), "{what}");
            }
        }
    }
}

/// Large gathers split the outputs across rayon's threads; an output whose layout
/// addresses one element more than once (as a stride-0 view from the FFI edge does) is
/// filled from one thread instead.
#[test]
fn parallel_gathers_split_only_outputs_that_address_each_element_once() {
    let (h, d, n) = (8, 128, 200);
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: h,
        head_dim: d,
        v_head_dim: d,
        block_size: 16,
        num_blocks: 16,
        layout: KvLayout::Nhd,
    };
    let mut pool = PoolCore::new(shape, DType::F32, Device::Cpu, None).unwrap();
    let id = pool.new_sequence();
    let k: Vec<f32> = (0..n * h * d).map(|x| x as f32).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let (kt, vt) = (
        TensorRef::from_f32(&k, &[n, h, d]).unwrap(),
        TensorRef::from_f32(&v, &[n, h, d]).unwrap(),
    );
    pool.append(id, 0, &kt, &vt).unwrap();

    // More than a megabyte: the parallel path, into plain C-order outputs.
    let (mut ko, mut vo) = (vec![0f32; h * n * d], vec![0f32; h * n * d]);
    {
        let mut kt = TensorMut::from_f32_mut(&mut ko, &[h, n, d]).unwrap();
        let mut vt = TensorMut::from_f32_mut(&mut vo, &[h, n, d]).unwrap();
        assert_eq!(pool.gather(id, 0, &mut kt, &mut vt).unwrap(), (0, n));
    }
    for p in 0..n {
        for head in 0..h {
            let got = &ko[(head * n + p) * d..][..d];
            assert_eq!(got, &k[(p * h + head) * d..][..d], "key {p}, head {head}");
            let got = &vo[(head * n + p) * d..][..d];
            assert_eq!(got, &v[(p * h + head) * d..][..d], "value {p}, head {head}");
        }
    }

    // Every position onto the same row (stride 0): one thread writes them in order, so
    // the last position's vectors remain.
    let (mut kr, mut vr) = (vec![0f32; h * d], vec![0f32; h * d]);
    {
        // SAFETY: both layouts address only `h * d` elements of their buffer, borrowed
        // for the tensors' life.
        let (mut kt, mut vt) = unsafe {
            (
                TensorMut::new(
                    kr.as_mut_ptr().cast(),
                    DType::F32,
                    &[h, n, d],
                    &[d as isize, 0, 1],
                )
                .unwrap(),
                TensorMut::new(
                    vr.as_mut_ptr().cast(),
                    DType::F32,
                    &[h, n, d],
                    &[d as isize, 0, 1],
                )
                .unwrap(),
            )
        };
        pool.gather(id, 0, &mut kt, &mut vt).unwrap();
    }
    assert_eq!(&kr[..], &k[(n - 1) * h * d..]);
    assert_eq!(&vr[..], &v[(n - 1) * h * d..]);
}
