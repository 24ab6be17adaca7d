//! A tiny ISO9660 reader (root directory files, with Joliet and Rock Ridge names) so the
//! simulator can read a NoCloud seed image, plus a minimal writer for tests and demos.

use std::collections::BTreeMap;

const SECTOR: usize = 2048;

/// Why an image could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsoError {
    /// Not an ISO9660 image or truncated.
    #[error("not a readable ISO9660 image: {0}")]
    Malformed(&'static str),
}

fn u32_le(b: &[u8], at: usize) -> Result<u32, IsoError> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(IsoError::Malformed("truncated field"))
}

/// A parsed image: volume id and the root directory's regular files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsoImage {
    /// Volume identifier (NoCloud seeds use `cidata`).
    pub volume_id: String,
    /// File name (lower-case, version suffix removed) → contents.
    pub files: BTreeMap<String, Vec<u8>>,
}

impl IsoImage {
    /// Reads the root directory of an image.
    pub fn parse(data: &[u8]) -> Result<Self, IsoError> {
        let mut pvd = None;
        let mut joliet = None;
        for i in 16..64 {
            let d = data
                .get(i * SECTOR..(i + 1) * SECTOR)
                .ok_or(IsoError::Malformed("no volume descriptor terminator"))?;
            if &d[1..6] != b"CD001" {
                return Err(IsoError::Malformed("missing CD001 signature"));
            }
            match d[0] {
                1 => pvd = Some(d),
                // Supplementary descriptor with a UCS-2 escape sequence = Joliet.
                2 if d[88] == 0x25 && d[89] == 0x2F => joliet = Some(d),
                255 => break,
                _ => {}
            }
        }
        let pvd = pvd.ok_or(IsoError::Malformed("no primary volume descriptor"))?;
        let volume_id = String::from_utf8_lossy(&pvd[40..72]).trim().to_string();
        let (desc, is_joliet) = match joliet {
            Some(j) => (j, true),
            None => (pvd, false),
        };
        let root = &desc[156..156 + 34];
        let extent = u32_le(root, 2)? as usize;
        let size = u32_le(root, 10)? as usize;
        let dir = data
            .get(extent * SECTOR..extent * SECTOR + size)
            .ok_or(IsoError::Malformed("root directory outside the image"))?;
        let mut files = BTreeMap::new();
        let mut pos = 0;
        while pos < dir.len() {
            let len = dir[pos] as usize;
            if len == 0 {
                // records do not cross sector boundaries; skip to the next sector
                pos = (pos / SECTOR + 1) * SECTOR;
                continue;
            }
            let rec = dir
                .get(pos..pos + len)
                .ok_or(IsoError::Malformed("truncated directory record"))?;
            pos += len;
            if rec.len() < 34 {
                return Err(IsoError::Malformed("short directory record"));
            }
            let flags = rec[25];
            let name_len = rec[32] as usize;
            let raw_name = rec
                .get(33..33 + name_len)
                .ok_or(IsoError::Malformed("truncated file name"))?;
            if flags & 0x02 != 0 || raw_name == [0] || raw_name == [1] {
                continue; // directories, "." and ".."
            }
            let mut name = if is_joliet {
                let units: Vec<u16> = raw_name
                    .chunks(2)
                    .filter(|c| c.len() == 2)
                    .map(|c| u16::from_be_bytes([c[0], c[1]]))
                    .collect();
                String::from_utf16_lossy(&units)
            } else {
                let su_start = 33 + name_len + (1 - name_len % 2);
                rock_ridge_name(rec.get(su_start..).unwrap_or(&[]))
                    .unwrap_or_else(|| String::from_utf8_lossy(raw_name).into_owned())
            };
            if let Some(i) = name.find(';') {
                name.truncate(i);
            }
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            let f_extent = u32_le(rec, 2)? as usize;
            let f_size = u32_le(rec, 10)? as usize;
            let content = data
                .get(f_extent * SECTOR..f_extent * SECTOR + f_size)
                .ok_or(IsoError::Malformed("file extent outside the image"))?;
            files.insert(name, content.to_vec());
        }
        Ok(Self { volume_id, files })
    }

    /// A file by name, matching `network-config` also as `network_config` (8.3-mangled names).
    pub fn file(&self, name: &str) -> Option<&[u8]> {
        let alt = name.replace('-', "_");
        self.files
            .get(name)
            .or_else(|| self.files.get(&alt))
            .map(Vec::as_slice)
    }
}

fn rock_ridge_name(su: &[u8]) -> Option<String> {
    let mut pos = 0;
    let mut name = String::new();
    while pos + 4 <= su.len() {
        let sig = &su[pos..pos + 2];
        let len = su[pos + 2] as usize;
        if len < 4 || pos + len > su.len() {
            break;
        }
        if sig == b"NM" && len >= 5 {
            name.push_str(&String::from_utf8_lossy(&su[pos + 5..pos + len]));
        }
        pos += len;
    }
    (!name.is_empty()).then_some(name)
}

/// Writes a minimal ISO9660 image (primary descriptor only, files in the root directory).
/// Enough for NoCloud seeds in tests; names are stored as given.
pub fn build_iso(volume_id: &str, files: &[(&str, &[u8])]) -> Vec<u8> {
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
    fn record(extent: u32, size: u32, flags: u8, name: &[u8]) -> Vec<u8> {
        let mut len = 33 + name.len();
        if len % 2 == 1 {
            len += 1;
        }
        let mut r = vec![0u8; len];
        r[0] = len as u8;
        r[2..10].copy_from_slice(&both32(extent));
        r[10..18].copy_from_slice(&both32(size));
        r[18..25].copy_from_slice(&[126, 1, 1, 0, 0, 0, 0]);
        r[25] = flags;
        r[28..32].copy_from_slice(&both16(1));
        r[32] = name.len() as u8;
        r[33..33 + name.len()].copy_from_slice(name);
        r
    }
    // layout: 0-15 system area, 16 PVD, 17 terminator, 18 L path table, 19 M path table,
    // 20 root directory (one sector), 21.. file data
    let root_sector = 20u32;
    let mut next = 21u32;
    let mut extents = Vec::new();
    for (_, data) in files {
        extents.push(next);
        next += (data.len().max(1)).div_ceil(SECTOR) as u32;
    }
    let total = next;
    let mut img = vec![0u8; total as usize * SECTOR];

    let mut dir = Vec::new();
    dir.extend(record(root_sector, SECTOR as u32, 2, &[0]));
    dir.extend(record(root_sector, SECTOR as u32, 2, &[1]));
    for ((name, data), extent) in files.iter().zip(&extents) {
        dir.extend(record(*extent, data.len() as u32, 0, name.as_bytes()));
    }
    let root_off = root_sector as usize * SECTOR;
    let dir_len = dir.len().min(SECTOR);
    img[root_off..root_off + dir_len].copy_from_slice(&dir[..dir_len]);
    for ((_, data), extent) in files.iter().zip(&extents) {
        let off = *extent as usize * SECTOR;
        img[off..off + data.len()].copy_from_slice(data);
    }

    let pvd = &mut img[16 * SECTOR..17 * SECTOR];
    pvd[0] = 1;
    pvd[1..6].copy_from_slice(b"CD001");
    pvd[6] = 1;
    pvd[8..40].fill(b' ');
    pvd[40..72].fill(b' ');
    let vid = volume_id.as_bytes();
    pvd[40..40 + vid.len().min(32)].copy_from_slice(&vid[..vid.len().min(32)]);
    pvd[80..88].copy_from_slice(&both32(total));
    pvd[120..124].copy_from_slice(&both16(1));
    pvd[124..128].copy_from_slice(&both16(1));
    pvd[128..132].copy_from_slice(&both16(SECTOR as u16));
    pvd[132..140].copy_from_slice(&both32(10));
    pvd[140..144].copy_from_slice(&18u32.to_le_bytes());
    pvd[148..152].copy_from_slice(&19u32.to_be_bytes());
    let root = record(root_sector, SECTOR as u32, 2, &[0]);
    pvd[156..156 + 34].copy_from_slice(&root[..34]);
    pvd[881] = 1;
    let term = &mut img[17 * SECTOR..18 * SECTOR];
    term[0] = 255;
    term[1..6].copy_from_slice(b"CD001");
    term[6] = 1;
    // path tables: one entry for the root
    let l = &mut img[18 * SECTOR..18 * SECTOR + 10];
    l[0] = 1;
    l[2..6].copy_from_slice(&root_sector.to_le_bytes());
    l[6..8].copy_from_slice(&1u16.to_le_bytes());
    let m = &mut img[19 * SECTOR..19 * SECTOR + 10];
    m[0] = 1;
    m[2..6].copy_from_slice(&root_sector.to_be_bytes());
    m[6..8].copy_from_slice(&1u16.to_be_bytes());
    img
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let iso = build_iso(
            "cidata",
            &[
                ("user-data", b"#cloud-config\n"),
                ("meta-data", b"instance-id: x\n"),
                ("network-config", b"version: 2\n"),
            ],
        );
        let img = IsoImage::parse(&iso).expect("parses");
        assert_eq!(img.volume_id, "cidata");
        assert_eq!(img.file("network-config"), Some(&b"version: 2\n"[..]));
        assert_eq!(img.files.len(), 3);
    }

    /// A Joliet descriptor with UCS-2 names wins over mangled primary names.
    #[test]
    fn joliet_names() {
        let data: &[u8] = b"version: 2\n";
        let mut iso = build_iso("cidata", &[("NETWORK_.;1", data)]);
        let file_extent = u32::from_le_bytes([
            iso[20 * SECTOR + 34 * 2 + 2],
            iso[20 * SECTOR + 34 * 2 + 3],
            iso[20 * SECTOR + 34 * 2 + 4],
            iso[20 * SECTOR + 34 * 2 + 5],
        ]);
        // append a Joliet root directory sector
        let jroot = (iso.len() / SECTOR) as u32;
        iso.extend(vec![0u8; SECTOR]);
        let name: Vec<u8> = "network-config"
            .encode_utf16()
            .flat_map(u16::to_be_bytes)
            .collect();
        let mut rec = vec![0u8; 33 + name.len() + (1 - name.len() % 2)];
        rec[0] = rec.len() as u8;
        rec[2..6].copy_from_slice(&file_extent.to_le_bytes());
        rec[10..14].copy_from_slice(&(data.len() as u32).to_le_bytes());
        rec[32] = name.len() as u8;
        rec[33..33 + name.len()].copy_from_slice(&name);
        let off = jroot as usize * SECTOR;
        iso[off..off + rec.len()].copy_from_slice(&rec);
        // sector 17 becomes the supplementary (Joliet) descriptor, 18 the terminator
        let mut svd = iso[16 * SECTOR..17 * SECTOR].to_vec();
        svd[0] = 2;
        svd[88..91].copy_from_slice(&[0x25, 0x2F, 0x45]);
        svd[156 + 2..156 + 6].copy_from_slice(&jroot.to_le_bytes());
        svd[156 + 10..156 + 14].copy_from_slice(&(SECTOR as u32).to_le_bytes());
        iso[17 * SECTOR..18 * SECTOR].copy_from_slice(&svd);
        let term = &mut iso[18 * SECTOR..19 * SECTOR];
        term.fill(0);
        term[0] = 255;
        term[1..6].copy_from_slice(b"CD001");
        let img = IsoImage::parse(&iso).expect("parses");
        assert_eq!(img.file("network-config"), Some(data));
        // without Joliet the mangled name still resolves through the '_' alias
        let plain =
            IsoImage::parse(&build_iso("cidata", &[("NETWORK_CONFIG;1", data)])).expect("parses");
        assert_eq!(plain.file("network-config"), Some(data));
    }

    #[test]
    fn rejects_garbage() {
        assert!(IsoImage::parse(b"hello").is_err());
        assert!(IsoImage::parse(&vec![0u8; 40 * SECTOR]).is_err());
    }

    #[test]
    fn rock_ridge_names() {
        let su = [
            b'N', b'M', 14, 1, 0, b'n', b'e', b't', b'w', b'o', b'r', b'k', b'-', b'c',
        ];
        assert_eq!(rock_ridge_name(&su).as_deref(), Some("network-c"));
    }
}
