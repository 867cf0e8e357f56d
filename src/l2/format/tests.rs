//! Round trips, corruption and geometry of the on-disk format.
use super::*;
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

fn slot() -> SlotHeader {
    SlotHeader {
        format_id: 0xdead_beef_1234,
        extent_epoch: 7,
        file_offset: slot_offset(256 * MIB, 3, stride_for(3 * MIB), 2),
        seq: 99,
        chunk_hash: [0xab; 32],
        kv_rank: 1,
        object_group: 2,
        model: "meta-llama/Llama-3-8B".into(),
        cache_salt: "sält".into(),
        object_len: 3 * MIB,
        payload_checksum: payload_checksum(b"payload"),
        layout: 0x1234_5678_9abc_def0,
    }
}

fn encoded(h: &SlotHeader) -> Vec<u8> {
    let mut buf = vec![0xffu8; BLOCK];
    h.encode(&mut buf).unwrap();
    buf
}

/// Re-seals arbitrary bytes so they pass magic/version/checksum checks.
fn forge(mut buf: Vec<u8>, magic: u64) -> Vec<u8> {
    seal(&mut buf, magic);
    buf
}

#[test]
fn superblock_round_trip() {
    let sb = Superblock {
        format_id: 42,
        file_bytes: 10 << 30,
        extent_bytes: 256 * MIB,
        update: 3,
        seq_limit: 5 << 32,
        epoch_limit: 7 << 32,
        checkpoint: 13,
        torn_below: 17,
    };
    assert_eq!(sb.offset(), SUPERBLOCK_OFFSETS[1]);
    let mut buf = vec![0xffu8; BLOCK];
    sb.encode(&mut buf);
    assert_eq!(Superblock::decode(&buf), Ok(sb));
}

#[test]
fn extent_header_round_trip() {
    let h = ExtentHeader {
        format_id: 42,
        extent_index: u32::MAX,
        epoch: u64::MAX,
        stride: stride_for(3 * MIB),
    };
    let mut buf = vec![0xffu8; BLOCK];
    h.encode(&mut buf);
    assert_eq!(ExtentHeader::decode(&buf), Ok(h));
}

#[test]
fn slot_header_round_trip_incl_max_strings() {
    let h = slot();
    assert_eq!(SlotHeader::decode(&encoded(&h)), Ok(h));
    let mut big = slot();
    big.model = "m".repeat(MAX_MODEL_BYTES);
    big.cache_salt = "é".repeat(MAX_SALT_BYTES / 2);
    assert_eq!(SlotHeader::decode(&encoded(&big)), Ok(big));
}

#[test]
fn all_zero_is_empty() {
    let z = vec![0u8; BLOCK];
    assert_eq!(Superblock::decode(&z), Err(FormatError::Empty));
    assert_eq!(ExtentHeader::decode(&z), Err(FormatError::Empty));
    assert_eq!(SlotHeader::decode(&z), Err(FormatError::Empty));
}

#[test]
fn wrong_kind_is_bad_magic() {
    let buf = encoded(&slot());
    assert_eq!(
        ExtentHeader::decode(&buf),
        Err(FormatError::BadMagic { found: SLOT_MAGIC })
    );
}

#[test]
fn wrong_length_rejected() {
    let buf = encoded(&slot());
    for len in [0, 1, BLOCK - 1, BLOCK + 1] {
        let mut b = buf.clone();
        b.resize(len, 0);
        assert!(matches!(
            SlotHeader::decode(&b),
            Err(FormatError::Invalid(_))
        ));
        assert!(matches!(
            Superblock::decode(&b),
            Err(FormatError::Invalid(_))
        ));
        assert!(matches!(
            ExtentHeader::decode(&b),
            Err(FormatError::Invalid(_))
        ));
    }
}

#[test]
#[should_panic]
fn encode_wrong_length_panics() {
    let _ = slot().encode(&mut [0u8; 100]);
}

#[test]
fn encode_rejects_bad_fields() {
    let mut buf = vec![0u8; BLOCK];
    let mut h = slot();
    h.model = "x".repeat(MAX_MODEL_BYTES + 1);
    assert_eq!(
        h.encode(&mut buf),
        Err(FormatError::FieldTooLong {
            field: "model",
            len: MAX_MODEL_BYTES + 1,
            max: MAX_MODEL_BYTES
        })
    );
    let mut h = slot();
    h.cache_salt = "x".repeat(MAX_SALT_BYTES + 1);
    assert!(matches!(
        h.encode(&mut buf),
        Err(FormatError::FieldTooLong {
            field: "cache_salt",
            ..
        })
    ));
    let mut h = slot();
    h.object_len = 0;
    assert!(matches!(h.encode(&mut buf), Err(FormatError::Invalid(_))));
}

#[test]
fn version_and_checksum_errors() {
    let mut buf = encoded(&slot());
    buf[VERSION] = 1; // the format before layout fingerprints
    assert_eq!(
        SlotHeader::decode(&buf),
        Err(FormatError::BadVersion { found: 1 })
    );
    let mut buf = encoded(&slot());
    buf[BLOCK - 1] ^= 1;
    assert_eq!(SlotHeader::decode(&buf), Err(FormatError::BadChecksum));
}

#[test]
fn every_bit_flip_detected() {
    let buf = encoded(&slot());
    for bit in 0..BLOCK * 8 {
        let mut b = buf.clone();
        b[bit / 8] ^= 1 << (bit % 8);
        assert!(SlotHeader::decode(&b).is_err(), "bit {bit} undetected");
    }
}

#[test]
fn field_sanity_after_valid_checksum() {
    let bad = |mut b: Vec<u8>, at: usize, v: u64, magic: u64| {
        put_u64(&mut b, at, v);
        forge(b, magic)
    };
    let sb = {
        let mut b = vec![0u8; BLOCK];
        Superblock {
            format_id: 1,
            file_bytes: EXTENT_BASE + 2 * MIB,
            extent_bytes: 2 * MIB,
            update: 1,
            seq_limit: 1,
            epoch_limit: 1,
            checkpoint: 0,
            torn_below: 0,
        }
        .encode(&mut b);
        b
    };
    assert!(Superblock::decode(&sb).is_ok());
    for (at, v) in [
        (BODY + 24, 0),
        (BODY + 16, 3 * MIB),
        (BODY + 16, 0),
        (BODY + 8, EXTENT_BASE),
    ] {
        let b = bad(sb.clone(), at, v, SUPERBLOCK_MAGIC);
        assert!(matches!(
            Superblock::decode(&b),
            Err(FormatError::Invalid(_))
        ));
    }
    let eh = {
        let mut b = vec![0u8; BLOCK];
        ExtentHeader {
            format_id: 1,
            extent_index: 0,
            epoch: 1,
            stride: 2 * B,
        }
        .encode(&mut b);
        b
    };
    for v in [B, 0, 2 * B + 1] {
        let b = bad(eh.clone(), BODY + 16, v, EXTENT_MAGIC);
        assert!(matches!(
            ExtentHeader::decode(&b),
            Err(FormatError::Invalid(_))
        ));
    }
    let sh = encoded(&slot());
    let b = bad(sh.clone(), BODY + 32, 0, SLOT_MAGIC);
    assert!(matches!(
        SlotHeader::decode(&b),
        Err(FormatError::Invalid(_))
    ));
    let mut b = sh.clone();
    put_u32(&mut b, S_MODEL_LEN, 5000);
    assert!(matches!(
        SlotHeader::decode(&forge(b, SLOT_MAGIC)),
        Err(FormatError::FieldTooLong { .. })
    ));
    let mut b = sh;
    b[S_STRINGS] = 0xff;
    assert!(matches!(
        SlotHeader::decode(&forge(b, SLOT_MAGIC)),
        Err(FormatError::Invalid(_))
    ));
}

#[test]
fn geometry_examples() {
    assert_eq!(stride_for(3 * MIB), 3 * MIB + B);
    assert_eq!(stride_for(1), 2 * B);
    assert_eq!(stride_for(B), 2 * B);
    assert_eq!(stride_for(B + 1), 3 * B);
    assert_eq!(slots_per_extent(256 * MIB, stride_for(3 * MIB)), 85);
    assert_eq!(slots_per_extent(256 * MIB, 0), 0);
    assert_eq!(
        extent_count(EXTENT_BASE + 10 * 256 * MIB + 5, 256 * MIB),
        10
    );
    assert_eq!(extent_count(MIB, 256 * MIB), 0);
    assert_eq!(extent_count(u64::MAX, 2 * MIB), u32::MAX);
    assert_eq!(extent_offset(256 * MIB, 0), EXTENT_BASE);
    assert_eq!(extent_offset(256 * MIB, 2), EXTENT_BASE + 512 * MIB);
    let stride = stride_for(3 * MIB);
    assert_eq!(
        slot_offset(256 * MIB, 1, stride, 0),
        EXTENT_BASE + 256 * MIB + B + 2 * B // the header, then 85 slots' table (2 blocks)
    );
    for slot in 0..85 {
        let off = slot_offset(256 * MIB, 4, stride, slot);
        assert_eq!(off % B, 0);
        assert!(off + stride <= extent_offset(256 * MIB, 5));
    }
    assert_eq!(default_extent_bytes(0), 0);
    assert_eq!(default_extent_bytes(EXTENT_BASE + MIB), 0);
    assert_eq!(default_extent_bytes(EXTENT_BASE + 2 * MIB), 2 * MIB);
    assert_eq!(default_extent_bytes(EXTENT_BASE + 20 * MIB), 4 * MIB);
    assert_eq!(default_extent_bytes(1 << 40), 256 * MIB);
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2 * BLOCK)) {
        let _ = Superblock::decode(&bytes);
        let _ = ExtentHeader::decode(&bytes);
        let _ = SlotHeader::decode(&bytes);
    }

    #[test]
    fn forged_blocks_never_panic(bytes in proptest::collection::vec(any::<u8>(), BLOCK)) {
        let _ = Superblock::decode(&forge(bytes.clone(), SUPERBLOCK_MAGIC));
        let _ = ExtentHeader::decode(&forge(bytes.clone(), EXTENT_MAGIC));
        let _ = SlotHeader::decode(&forge(bytes, SLOT_MAGIC));
    }

    #[test]
    fn slot_round_trip_and_bit_flips(
        model in "\\PC{0,64}",
        salt in "\\PC{0,64}",
        seq: u64,
        object_len in 1u64..,
        bit in 0..BLOCK * 8,
    ) {
        let h = SlotHeader { model, cache_salt: salt, seq, object_len, ..slot() };
        let mut b = encoded(&h);
        prop_assert_eq!(SlotHeader::decode(&b), Ok(h));
        b[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(SlotHeader::decode(&b).is_err());
    }

    #[test]
    fn default_extent_bytes_valid(file_bytes: u64) {
        let e = default_extent_bytes(file_bytes);
        if e != 0 {
            let sb = Superblock {
                format_id: 1,
                file_bytes,
                extent_bytes: e,
                update: 1,
                seq_limit: 1,
                epoch_limit: 1,
                checkpoint: 0,
                torn_below: 0,
            };
            let mut b = vec![0u8; BLOCK];
            sb.encode(&mut b);
            prop_assert_eq!(Superblock::decode(&b), Ok(sb));
            prop_assert!(extent_count(file_bytes, e) >= 1);
        }
    }
}
