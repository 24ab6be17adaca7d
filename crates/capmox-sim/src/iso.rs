//! A tiny ISO9660 reader (root directory files, with Joliet and Rock Ridge names) so the
//! simulator can read a NoCloud seed image, re-exporting the
//! NoCloud image writer of [`capmox::cloudinit::iso`] for tests and demos.

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

/// The image writer lives with the NoCloud renderers; the simulator and its tests use it too.
pub use capmox::cloudinit::iso::build_iso;

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

    /// The Joliet (UCS-2) names of a seed image resolve to the full NoCloud file names.
    #[test]
    fn joliet_names() {
        let data: &[u8] = b"version: 2\n";
        let iso = build_iso(
            "cidata",
            &[("network-config", data), ("user-data", b"#cloud-config\n")],
        );
        let img = IsoImage::parse(&iso).expect("parses");
        assert_eq!(img.file("network-config"), Some(data));
        assert_eq!(img.file("user-data"), Some(&b"#cloud-config\n"[..]));
        assert_eq!(img.file("meta-data"), None);
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
