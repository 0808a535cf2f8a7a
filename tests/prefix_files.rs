//! Prefix-cache files record the saving pool's model id: a pool of another model (same
//! seed, same shape) refuses them, before and after checking, and its cache is unchanged.

use kvrs::unstable::{read_file, PoolCore, TensorRef};
use kvrs::{DType, Device, HashKind, KvError, KvLayout, PagedShape, PrefixConfig};

const BS: usize = 4;

/// A one-layer pool of seed 3 with `model_id`, holding the two whole blocks of 0..9.
fn pool(model_id: &str, cached: bool) -> PoolCore {
    let shape = PagedShape {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 2,
        v_head_dim: 2,
        block_size: BS,
        num_blocks: 8,
        layout: KvLayout::Nhd,
    };
    let prefix = PrefixConfig {
        hash: HashKind::Blake3,
        seed: 3,
        partial_hits: true,
        events: false,
    };
    let mut p = PoolCore::new(shape, DType::F32, Device::Cpu, Some(prefix))
        .unwrap()
        .with_model_id(model_id);
    if cached {
        let tokens: Vec<u32> = (0..9).collect();
        let id = p.new_sequence_with(&tokens, b"", b"");
        let kv = vec![42f32; 2 * BS * 2];
        let t = TensorRef::from_f32(&kv, &[2 * BS, 1, 2]).unwrap();
        p.append(id, 0, &t, &t).unwrap();
        p.advance(id, (2 * BS) as i64, None).unwrap();
        p.free_sequence(id).unwrap();
    }
    p
}

#[test]
fn a_file_loads_only_into_a_pool_of_its_model_id() {
    let dir = std::env::temp_dir().join(format!("kvrs-prefix-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("a.kvc");
    let a = pool("model-a", true);
    assert_eq!(a.model_id(), "model-a");
    assert_eq!(a.save_prefix_cache(&path).unwrap(), 2);
    let probe: Vec<u32> = (0..9).collect();

    for other in ["model-b", ""] {
        let mut b = pool(other, false);
        match b.load_prefix_cache(&path) {
            Err(KvError::BadFile { reason, .. }) => {
                let want = format!(
                    "written by a pool with model_id \"model-a\", this pool's model_id is \"{other}\""
                );
                assert!(reason.contains(&want), "{reason}");
            }
            r => panic!("{r:?}"),
        }
        assert_eq!(b.match_prefix(&probe, b"", b""), 0);
        assert_eq!(b.stats().cached_blocks, 0);
        b.check_invariants().unwrap();

        // A file checked for model-a's pool is refused by another model's.
        let checked = a
            .prefix_file_config()
            .unwrap()
            .check(&path, read_file(&path).unwrap())
            .unwrap();
        assert!(matches!(
            b.commit_file(checked),
            Err(KvError::InvalidArgument { name: "file", .. })
        ));
        assert_eq!(b.stats().cached_blocks, 0);
    }

    let mut same = pool("model-a", false);
    let report = same.load_prefix_cache(&path).unwrap();
    assert_eq!((report.loaded, report.skipped), (2, 0));
    assert_eq!(same.match_prefix(&probe, b"", b""), 8);

    // Pools without a model id share files with each other only.
    let empty = pool("", true);
    empty.save_prefix_cache(&path).unwrap();
    assert_eq!(pool("", false).load_prefix_cache(&path).unwrap().loaded, 2);
    assert!(pool("model-a", false).load_prefix_cache(&path).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_file_is_an_io_error() {
    let path = std::path::Path::new("/nonexistent/kvrs/prefix.kvc");
    assert!(matches!(read_file(path), Err(KvError::Io { .. })));
}
