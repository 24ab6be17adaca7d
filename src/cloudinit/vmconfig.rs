//! The two inputs cloud-init takes from the VM config read back from Proxmox: the SMBIOS UUID
//! (the instance id) and each NIC's MAC address; and the `smbios1` that gives a VM without a
//! UUID one.

/// Instance id from a VM's `smbios1` value (`uuid=…,manufacturer=…`): the UUID, lower-case in
/// its canonical 8-4-4-4-12 form as the Go provider writes it; `None` when absent or malformed.
pub fn instance_id_from_smbios(smbios1: &str) -> Option<String> {
    let uuid = smbios1
        .split(',')
        .find_map(|part| part.trim().strip_prefix("uuid="))?;
    let hex: String = uuid.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let hex = hex.to_ascii_lowercase();
    Some(hyphenated(&hex))
}

/// A random (version 4, RFC 9562) UUID in canonical lower-case form, from 16 random bytes.
pub fn uuid_v4(mut bytes: [u8; 16]) -> String {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    hyphenated(&hex)
}

/// 32 hex digits in the canonical 8-4-4-4-12 form (callers guarantee the length).
fn hyphenated(hex: &str) -> String {
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// The `smbios1` value that gives a VM `uuid`, keeping the other SMBIOS fields of `current`
/// (a malformed `uuid=` is dropped with it); the UUID comes first, as Proxmox writes it.
pub fn smbios_with_uuid(current: Option<&str>, uuid: &str) -> String {
    let kept = current
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty() && !part.starts_with("uuid="));
    std::iter::once(format!("uuid={uuid}"))
        .chain(kept.map(str::to_owned))
        .collect::<Vec<_>>()
        .join(",")
}

/// MAC address of a NIC from its VM config value (`virtio=BC:24:11:2E:5C:01,bridge=vmbr0`, or
/// `macaddr=…`); `None` when the value carries no MAC.
pub fn mac_from_net_config(net: &str) -> Option<String> {
    const MODELS: [&str; 5] = ["virtio", "e1000", "rtl8139", "vmxnet3", "macaddr"];
    net.split(',').find_map(|part| {
        let (key, value) = part.trim().split_once('=')?;
        let octets: Vec<&str> = value.split(':').collect();
        let is_mac = octets.len() == 6
            && octets
                .iter()
                .all(|o| o.len() == 2 && o.chars().all(|c| c.is_ascii_hexdigit()));
        (MODELS.contains(&key) && is_mac).then(|| value.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_id_is_the_canonical_lower_case_smbios_uuid() {
        assert_eq!(
            instance_id_from_smbios("uuid=9B9F5A46-0C1D-4F7E-8B1A-1C2D3E4F5A6B").as_deref(),
            Some("9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b")
        );
        assert_eq!(
            instance_id_from_smbios(
                "manufacturer=UVJPWE1PWA==,base64=1,uuid=9b9f5a460c1d4f7e8b1a1c2d3e4f5a6b"
            )
            .as_deref(),
            Some("9b9f5a46-0c1d-4f7e-8b1a-1c2d3e4f5a6b")
        );
        assert_eq!(instance_id_from_smbios("manufacturer=x"), None);
        assert_eq!(instance_id_from_smbios("uuid=not-a-uuid"), None);
    }

    #[test]
    fn a_vm_without_a_uuid_gets_one_and_keeps_its_other_smbios_fields() {
        let uuid = uuid_v4([0xff; 16]);
        assert_eq!(
            uuid, "ffffffff-ffff-4fff-bfff-ffffffffffff",
            "version 4, RFC variant"
        );
        assert_eq!(uuid_v4([0; 16]), "00000000-0000-4000-8000-000000000000");
        assert_eq!(smbios_with_uuid(None, &uuid), format!("uuid={uuid}"));
        let given = smbios_with_uuid(Some("manufacturer=SGFuZA==,base64=1"), &uuid);
        assert_eq!(given, format!("uuid={uuid},manufacturer=SGFuZA==,base64=1"));
        assert_eq!(
            instance_id_from_smbios(&given).as_deref(),
            Some(uuid.as_str())
        );
        assert_eq!(
            smbios_with_uuid(Some("uuid=not-a-uuid,serial=7"), &uuid),
            format!("uuid={uuid},serial=7"),
            "a malformed UUID is replaced"
        );
    }

    #[test]
    fn mac_comes_from_the_model_key_or_macaddr() {
        assert_eq!(
            mac_from_net_config("virtio=BC:24:11:2E:5C:01,bridge=vmbr0,firewall=1").as_deref(),
            Some("BC:24:11:2E:5C:01")
        );
        assert_eq!(
            mac_from_net_config("model=e1000,macaddr=52:54:00:12:34:56,bridge=vmbr1").as_deref(),
            Some("52:54:00:12:34:56")
        );
        assert_eq!(mac_from_net_config("virtio,bridge=vmbr0"), None);
        assert_eq!(mac_from_net_config("bridge=vmbr0,tag=12"), None);
    }
}
