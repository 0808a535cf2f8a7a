//! Criterion benches of the contiguous cache: single-token append (decode), long append
//! (prefill, with and without dtype conversion) and block reads.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvrs::unstable::{CacheCore, CacheShape, TensorMut, TensorRef};
use kvrs::{DType, Device};

const HEADS: usize = 8;
const DIM: usize = 128;

fn cache(max_seq_len: usize, num_layers: usize) -> CacheCore {
    let shape = CacheShape {
        num_layers,
        num_kv_heads: HEADS,
        head_dim: DIM,
        v_head_dim: DIM,
        max_seq_len,
    };
    CacheCore::new(shape, DType::F16, Device::Cpu).unwrap()
}

fn tensor<'a>(buf: &'a [u8], dtype: DType, shape: &[usize]) -> TensorRef<'a> {
    TensorRef::from_bytes(buf, dtype, shape).unwrap()
}

fn tensor_mut<'a>(buf: &'a mut [u8], dtype: DType, shape: &[usize]) -> TensorMut<'a> {
    TensorMut::from_bytes_mut(buf, dtype, shape).unwrap()
}

fn decode(c: &mut Criterion) {
    let mut kv = cache(8192, 32);
    let token = vec![0u8; HEADS * DIM * 2];
    let t = tensor(&token, DType::F16, &[1, HEADS, DIM]);
    c.bench_function("decode_append_32_layers_fp16", |b| {
        b.iter(|| {
            kv.truncate(1000).unwrap();
            if kv.seq_len() < 1000 {
                kv.set_seq_len(1000).unwrap();
            }
            for layer in 0..32 {
                kv.append(layer, &t, &t).unwrap();
            }
            kv.advance(1).unwrap();
        })
    });
}

fn prefill(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefill_append_4096");
    for (name, dtype) in [("fp16_to_fp16", DType::F16), ("fp32_to_fp16", DType::F32)] {
        let buf = vec![0u8; 4096 * HEADS * DIM * dtype.size()];
        let t = tensor(&buf, dtype, &[4096, HEADS, DIM]);
        let mut kv = cache(4096, 1);
        group.throughput(Throughput::Bytes(2 * buf.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &t, |b, t| {
            b.iter(|| {
                kv.clear();
                kv.append(0, t, t).unwrap();
            })
        });
    }
    group.finish();
}

fn read(c: &mut Criterion) {
    let kv = cache(4096, 1);
    let mut k = vec![0u8; 4096 * HEADS * DIM * 2];
    let mut v = vec![0u8; 4096 * HEADS * DIM * 2];
    let mut group = c.benchmark_group("extract_block_4096");
    group.throughput(Throughput::Bytes(2 * k.len() as u64));
    group.bench_function("fp16", |b| {
        b.iter(|| {
            let mut tk = tensor_mut(&mut k, DType::F16, &[HEADS, 4096, DIM]);
            let mut tv = tensor_mut(&mut v, DType::F16, &[HEADS, 4096, DIM]);
            kv.extract_block(0, 0, 4096, &mut tk, &mut tv).unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, decode, prefill, read);
criterion_main!(benches);
