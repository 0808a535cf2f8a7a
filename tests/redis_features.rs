//! The Redis tier built without the `redis-tls` feature (`make test` builds the simulated
//! device's tests with `cuda-sim,redis`): a `rediss://` URL is refused when the tier is made,
//! with an error that names the feature; plain URLs are unchanged.
#![cfg(all(feature = "redis", not(feature = "redis-tls")))]

use std::time::Duration;

use kvrs::tier::{RedisTier, TlsOptions};
use kvrs::KvError;

fn tier(url: &str, tls: &TlsOptions) -> kvrs::Result<RedisTier> {
    let (timeout, retry) = (Duration::from_millis(100), Duration::from_secs(1));
    RedisTier::with_tls(url, timeout, None, 1, retry, tls)
}

#[test]
fn a_rediss_url_names_the_feature_to_build_with() {
    for url in ["rediss://127.0.0.1:6380/0", "valkeys://localhost:6380"] {
        match tier(url, &TlsOptions::default()) {
            Err(KvError::NotSupported(m)) => assert!(m.contains("`redis-tls`"), "{m}"),
            other => panic!("{url}: {other:?}"),
        }
    }
}

#[test]
fn plain_urls_and_misplaced_tls_options_are_as_with_tls() {
    let t = tier(
        "redis://user:secret@127.0.0.1:6380/2",
        &TlsOptions::default(),
    )
    .unwrap();
    assert_eq!(t.url(), "redis://user:***@127.0.0.1:6380/2");
    let ca = TlsOptions {
        ca: Some("ca.pem".into()),
        ..TlsOptions::default()
    };
    match tier("redis://127.0.0.1:6380/0", &ca) {
        Err(KvError::InvalidArgument { name: "tls_ca", .. }) => {}
        other => panic!("{other:?}"),
    }
}
