//! A small ISO9660 writer for NoCloud seeds: files in the root directory, named three ways so
//! every reader finds them — Rock Ridge `NM` and Joliet (what Linux and cloud-init use:
//! `user-data`, `network-config`) and level-1 ISO names (`USER_DAT.;1`) for the rest.
//! Timestamps are fixed, so the same files always give the same bytes.
//!
//! Layout (2048-byte sectors): 0–15 system area, 16 primary descriptor, 17 Joliet descriptor,
//! 18 terminator, 19–22 path tables (primary L/M, Joliet L/M), then the primary root directory,
//! the Joliet root directory, and the file data (shared by both directory trees).

/// Volume id cloud-init's NoCloud datasource looks for.
pub const NOCLOUD_VOLUME_ID: &str = "cidata";

const SECTOR: usize = 2048;
/// 2000-01-01 00:00:00 UTC: the timestamp of every file and descriptor.
const DATE_DIGITS: &[u8; 16] = b"2000010100000000";
const RECORD_DATE: [u8; 7] = [100, 1, 1, 0, 0, 0, 0];

const PRIMARY_PATH_L: u32 = 19;
const PRIMARY_PATH_M: u32 = PRIMARY_PATH_L + 1;
const JOLIET_PATH_L: u32 = 21;
const JOLIET_PATH_M: u32 = JOLIET_PATH_L + 1;
const FIRST_FREE: u32 = 23;

const RRIP_ID: &[u8] = b"RRIP_1991A";
const RRIP_DESCRIPTION: &[u8] =
    b"THE ROCK RIDGE INTERCHANGE PROTOCOL PROVIDES SUPPORT FOR POSIX FILE SYSTEM SEMANTICS";

fn both32(v: u32) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&v.to_le_bytes());
    out[4..].copy_from_slice(&v.to_be_bytes());
    out
}

fn both16(v: u16) -> [u8; 4] {
    let mut out = [0u8; 4];
    out[..2].copy_from_slice(&v.to_le_bytes());
    out[2..].copy_from_slice(&v.to_be_bytes());
    out
}

/// Sector count of `len` bytes (at least one, so every file has its own extent).
fn sectors(len: usize) -> u32 {
    // An ISO9660 image addresses at most 2^32 sectors; seeds are kilobytes.
    u32::try_from(len.max(1).div_ceil(SECTOR)).unwrap_or(u32::MAX)
}

/// A directory record: `name` is the identifier, `system_use` the SUSP/Rock Ridge entries.
fn record(extent: u32, size: u32, directory: bool, name: &[u8], system_use: &[u8]) -> Vec<u8> {
    let pad = usize::from(name.len().is_multiple_of(2));
    let len = 33 + name.len() + pad + system_use.len();
    let len = len + len % 2;
    let mut r = vec![0u8; len];
    // Records are at most 255 bytes; our names are short and SUSP areas small (checked in tests).
    r[0] = u8::try_from(len).unwrap_or(u8::MAX);
    r[2..10].copy_from_slice(&both32(extent));
    r[10..18].copy_from_slice(&both32(size));
    r[18..25].copy_from_slice(&RECORD_DATE);
    r[25] = if directory { 2 } else { 0 };
    r[28..32].copy_from_slice(&both16(1));
    r[32] = u8::try_from(name.len()).unwrap_or(u8::MAX);
    r[33..33 + name.len()].copy_from_slice(name);
    let su = 33 + name.len() + pad;
    r[su..su + system_use.len()].copy_from_slice(system_use);
    r
}

/// Rock Ridge `PX` (POSIX mode, links, uid, gid) in its RRIP 1991A (36-byte) form.
fn rr_px(mode: u32, links: u32) -> Vec<u8> {
    let mut e = vec![b'P', b'X', 36, 1];
    e.extend(both32(mode));
    e.extend(both32(links));
    e.extend(both32(0));
    e.extend(both32(0));
    e
}

/// Rock Ridge `NM`: the real file name.
fn rr_nm(name: &str) -> Vec<u8> {
    let mut e = vec![
        b'N',
        b'M',
        u8::try_from(5 + name.len()).unwrap_or(u8::MAX),
        1,
        0,
    ];
    e.extend(name.as_bytes());
    e
}

/// SUSP `SP` (marks SUSP in use) and `ER` (names Rock Ridge) for the root's `.` record.
fn root_susp() -> Vec<u8> {
    let mut e = vec![b'S', b'P', 7, 1, 0xBE, 0xEF, 0];
    let er_len = 8 + RRIP_ID.len() + RRIP_DESCRIPTION.len();
    e.extend([
        b'E',
        b'R',
        u8::try_from(er_len).unwrap_or(u8::MAX),
        1,
        u8::try_from(RRIP_ID.len()).unwrap_or(u8::MAX),
        u8::try_from(RRIP_DESCRIPTION.len()).unwrap_or(u8::MAX),
        0,
        1,
    ]);
    e.extend(RRIP_ID);
    e.extend(RRIP_DESCRIPTION);
    e
}

fn ucs2(s: &str) -> Vec<u8> {
    s.encode_utf16().flat_map(u16::to_be_bytes).collect()
}

/// Level-1 ISO9660 name (`USER_DAT.;1`): d-characters, 8.3, unique among `taken`.
fn short_name(name: &str, taken: &[Vec<u8>]) -> Vec<u8> {
    let clean = |s: &str, n: usize| -> String {
        s.chars()
            .map(|c| {
                let c = c.to_ascii_uppercase();
                if c.is_ascii_uppercase() || c.is_ascii_digit() {
                    c
                } else {
                    '_'
                }
            })
            .take(n)
            .collect()
    };
    let (stem, ext) = match name.rsplit_once('.') {
        Some((s, e)) if !s.is_empty() => (clean(s, 8), clean(e, 3)),
        _ => (clean(name, 8), String::new()),
    };
    let mut candidate = format!("{stem}.{ext};1").into_bytes();
    let mut n = 1u32;
    while taken.contains(&candidate) {
        let suffix = n.to_string();
        let keep = stem.len().min(8 - suffix.len().min(7));
        candidate = format!("{}{suffix}.{ext};1", &stem[..keep]).into_bytes();
        n += 1;
    }
    candidate
}

/// Fills a volume descriptor's text field with `value` padded by spaces (or UCS-2 spaces).
fn text_field(field: &mut [u8], value: &str, joliet: bool) {
    if joliet {
        for pair in field.chunks_mut(2) {
            pair.copy_from_slice(&[0, b' '][..pair.len()]);
        }
        let v = ucs2(value);
        let n = v.len().min(field.len()) & !1;
        field[..n].copy_from_slice(&v[..n]);
    } else {
        field.fill(b' ');
        let v = value.as_bytes();
        let n = v.len().min(field.len());
        field[..n].copy_from_slice(&v[..n]);
    }
}

fn descriptor(
    img: &mut [u8],
    sector: usize,
    volume_id: &str,
    total: u32,
    root: &[u8],
    path_l: u32,
    joliet: bool,
) {
    let path_m = path_l + 1;
    let d = &mut img[sector * SECTOR..(sector + 1) * SECTOR];
    d[0] = if joliet { 2 } else { 1 };
    d[1..6].copy_from_slice(b"CD001");
    d[6] = 1;
    text_field(&mut d[8..40], "", joliet);
    text_field(&mut d[40..72], volume_id, joliet);
    d[80..88].copy_from_slice(&both32(total));
    if joliet {
        d[88..91].copy_from_slice(b"%/E"); // UCS-2 level 3
    }
    d[120..124].copy_from_slice(&both16(1));
    d[124..128].copy_from_slice(&both16(1));
    d[128..132].copy_from_slice(&both16(SECTOR as u16));
    d[132..140].copy_from_slice(&both32(10)); // one path table entry: the root
    d[140..144].copy_from_slice(&path_l.to_le_bytes());
    d[148..152].copy_from_slice(&path_m.to_be_bytes());
    d[156..190].copy_from_slice(&root[..34]);
    for (from, to) in [(190, 318), (318, 446), (446, 574), (574, 702)] {
        text_field(&mut d[from..to], "", joliet);
    }
    for (from, to) in [(702, 739), (739, 776), (776, 813)] {
        text_field(&mut d[from..to], "", joliet);
    }
    for at in [813, 830, 864] {
        d[at..at + 16].copy_from_slice(DATE_DIGITS);
    }
    d[847..863].fill(b'0'); // no expiration date
    d[881] = 1;
}

fn path_table(img: &mut [u8], sector: u32, root: u32, big_endian: bool) {
    let at = sector as usize * SECTOR;
    let e = &mut img[at..at + 10];
    e[0] = 1;
    if big_endian {
        e[2..6].copy_from_slice(&root.to_be_bytes());
        e[6..8].copy_from_slice(&1u16.to_be_bytes());
    } else {
        e[2..6].copy_from_slice(&root.to_le_bytes());
        e[6..8].copy_from_slice(&1u16.to_le_bytes());
    }
}

/// Lays directory records into sectors (a record never crosses a sector boundary).
fn directory(records: Vec<Vec<u8>>) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        let used = out.len() % SECTOR;
        if used + r.len() > SECTOR {
            out.resize(out.len() + SECTOR - used, 0);
        }
        out.extend(r);
    }
    out.resize(sectors(out.len()) as usize * SECTOR, 0);
    out
}

/// Writes an ISO9660 image with Joliet and Rock Ridge names and the files (name, bytes) in its
/// root directory, in the given data order. Names are kept as given, up to 64 characters.
pub fn build_iso(volume_id: &str, files: &[(&str, &[u8])]) -> Vec<u8> {
    // Data extents first (their positions depend on the directory sizes, so size those first).
    let mut short = Vec::new();
    for (name, _) in files {
        let s = short_name(name, &short);
        short.push(s);
    }
    // Names are capped at 64 characters (Joliet's limit) so every record fits its length byte.
    let rr_file = |name: &str| {
        let name: String = name.chars().take(64).collect();
        [rr_px(0o100_444, 1), rr_nm(&name)].concat()
    };
    let rr_dir = rr_px(0o040_555, 2);
    let primary_len = |root: u32, extents: &[u32], dir_size: u32| {
        let mut recs = vec![
            record(
                root,
                dir_size,
                true,
                &[0],
                &[root_susp(), rr_dir.clone()].concat(),
            ),
            record(root, dir_size, true, &[1], &rr_dir),
        ];
        let mut sorted: Vec<usize> = (0..files.len()).collect();
        sorted.sort_by(|a, b| short[*a].cmp(&short[*b]));
        for i in sorted {
            let size = u32::try_from(files[i].1.len()).unwrap_or(u32::MAX);
            recs.push(record(
                extents[i],
                size,
                false,
                &short[i],
                &rr_file(files[i].0),
            ));
        }
        directory(recs)
    };
    let joliet_names: Vec<Vec<u8>> = files
        .iter()
        .map(|(n, _)| ucs2(&n.chars().take(64).collect::<String>()))
        .collect();
    let joliet_len = |root: u32, extents: &[u32], dir_size: u32| {
        let mut recs = vec![
            record(root, dir_size, true, &[0], &[]),
            record(root, dir_size, true, &[1], &[]),
        ];
        let mut sorted: Vec<usize> = (0..files.len()).collect();
        sorted.sort_by(|a, b| joliet_names[*a].cmp(&joliet_names[*b]));
        for i in sorted {
            let size = u32::try_from(files[i].1.len()).unwrap_or(u32::MAX);
            recs.push(record(extents[i], size, false, &joliet_names[i], &[]));
        }
        directory(recs)
    };
    // Sizes do not depend on extent numbers, so measure with placeholders.
    let zeros = vec![0u32; files.len()];
    let primary_sectors = sectors(primary_len(0, &zeros, 0).len());
    let joliet_sectors = sectors(joliet_len(0, &zeros, 0).len());
    let primary_root = FIRST_FREE;
    let joliet_root = primary_root + primary_sectors;
    let mut next = joliet_root + joliet_sectors;
    let mut extents = Vec::new();
    for (_, data) in files {
        extents.push(next);
        next += sectors(data.len());
    }
    let total = next;
    let mut img = vec![0u8; total as usize * SECTOR];

    let pdir = primary_len(primary_root, &extents, primary_sectors * SECTOR as u32);
    let jdir = joliet_len(joliet_root, &extents, joliet_sectors * SECTOR as u32);
    let at = primary_root as usize * SECTOR;
    img[at..at + pdir.len()].copy_from_slice(&pdir);
    let at = joliet_root as usize * SECTOR;
    img[at..at + jdir.len()].copy_from_slice(&jdir);
    for ((_, data), extent) in files.iter().zip(&extents) {
        let at = *extent as usize * SECTOR;
        img[at..at + data.len()].copy_from_slice(data);
    }

    let proot = record(
        primary_root,
        primary_sectors * SECTOR as u32,
        true,
        &[0],
        &[],
    );
    let jroot = record(joliet_root, joliet_sectors * SECTOR as u32, true, &[0], &[]);
    descriptor(
        &mut img,
        16,
        volume_id,
        total,
        &proot,
        PRIMARY_PATH_L,
        false,
    );
    descriptor(&mut img, 17, volume_id, total, &jroot, JOLIET_PATH_L, true);
    let term = &mut img[18 * SECTOR..19 * SECTOR];
    term[0] = 255;
    term[1..6].copy_from_slice(b"CD001");
    term[6] = 1;
    path_table(&mut img, PRIMARY_PATH_L, primary_root, false);
    path_table(&mut img, PRIMARY_PATH_M, primary_root, true);
    path_table(&mut img, JOLIET_PATH_L, joliet_root, false);
    path_table(&mut img, JOLIET_PATH_M, joliet_root, true);
    img
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILES: [(&str, &[u8]); 3] = [
        ("user-data", b"#cloud-config\nruncmd: []\n"),
        ("meta-data", b"instance-id: x\n"),
        ("network-config", b"network:\n  version: 2\n"),
    ];

    #[test]
    fn same_files_give_the_same_bytes() {
        assert_eq!(build_iso("cidata", &FILES), build_iso("cidata", &FILES));
        assert_ne!(
            build_iso("cidata", &FILES),
            build_iso("cidata", &FILES[..2]),
            "content must matter"
        );
    }

    #[test]
    fn short_names_are_level_one_and_unique() {
        let mut taken = Vec::new();
        for n in ["user-data", "user-data-2", "network-config", "a.b.c"] {
            let s = short_name(n, &taken);
            taken.push(s);
        }
        let names: Vec<String> = taken
            .iter()
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect();
        assert_eq!(
            names,
            ["USER_DAT.;1", "USER_DA1.;1", "NETWORK_.;1", "A_B.C;1"]
        );
    }

    #[test]
    fn every_directory_record_fits_its_length_byte() {
        let su = [root_susp(), rr_px(0o040_555, 2)].concat();
        let r = record(1, 2048, true, &[0], &su);
        assert!(r.len() <= 255, "root record is {} bytes", r.len());
        let r = record(
            1,
            1,
            false,
            b"NETWORK_.;1",
            &[rr_px(0, 1), rr_nm(&"n".repeat(64))].concat(),
        );
        assert!(r.len() <= 255, "file record is {} bytes", r.len());
        assert_eq!(r.len() % 2, 0);
    }
}
