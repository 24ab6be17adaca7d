//! Watched objects decoded without their managed fields: nothing reads them from the caches,
//! and decoding them into JSON trees was a large share of every watch event's cost (a machine's
//! status is written several times as it provisions, and each write comes back as an event).

use std::borrow::Cow;
use std::fmt;

use kube::Resource;
use kube::api::{Api, ObjectMeta};
use kube::runtime::watcher;
use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, IgnoredAny, MapAccess};

/// The member of a watched object that is skipped unread, as a path of keys.
const MANAGED_FIELDS: &[&str] = &["metadata", "managedFields"];

/// `K` as its watch decodes it: without `metadata.managedFields`.
#[derive(Clone, Debug)]
pub struct Lean<K>(pub K);

impl<K: Resource<DynamicType = ()>> Resource for Lean<K> {
    type DynamicType = ();
    // The URL is built from the namespace an `Api` is given, as for `K` itself.
    type Scope = kube::core::DynamicResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        self.0.meta()
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        self.0.meta_mut()
    }
}

impl<'de, K: DeserializeOwned> de::Deserialize<'de> for Lean<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        K::deserialize(Without {
            inner: deserializer,
            path: MANAGED_FIELDS,
        })
        .map(Lean)
    }
}

/// The `Api` of `api`'s kind and namespace whose objects decode as [`Lean`].
pub fn api<K: Resource<DynamicType = ()> + Clone>(api: &Api<K>) -> Api<Lean<K>> {
    let client = api.clone().into_client();
    match api.namespace() {
        Some(namespace) => Api::namespaced_with(client, namespace, &()),
        None => Api::all_with(client, &()),
    }
}

/// A watch event of [`Lean`] objects as one of the objects themselves.
pub fn event<K>(event: watcher::Event<Lean<K>>) -> watcher::Event<K> {
    use watcher::Event;
    match event {
        Event::Apply(Lean(object)) => Event::Apply(object),
        Event::Delete(Lean(object)) => Event::Delete(object),
        Event::Init => Event::Init,
        Event::InitApply(Lean(object)) => Event::InitApply(object),
        Event::InitDone => Event::InitDone,
    }
}

/// Decodes what `inner` holds, leaving out the member at `path` (keys of nested objects).
struct Without<'p, D> {
    inner: D,
    path: &'p [&'static str],
}

/// Forwards the deserializer methods that cannot hold an object, unchanged.
macro_rules! forward_plain {
    ($($method:ident)*) => {
        $(
            fn $method<V: de::Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
                self.inner.$method(visitor)
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Without<'_, D> {
    type Error = D::Error;

    fn deserialize_any<V: de::Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let visitor = WithoutVisitor {
            inner: visitor,
            path: self.path,
        };
        self.inner.deserialize_any(visitor)
    }

    fn deserialize_map<V: de::Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let visitor = WithoutVisitor {
            inner: visitor,
            path: self.path,
        };
        self.inner.deserialize_map(visitor)
    }

    fn deserialize_struct<V: de::Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let visitor = WithoutVisitor {
            inner: visitor,
            path: self.path,
        };
        self.inner.deserialize_struct(name, fields, visitor)
    }

    forward_plain! {
        deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char deserialize_str
        deserialize_string deserialize_bytes deserialize_byte_buf deserialize_option
        deserialize_unit deserialize_seq deserialize_identifier deserialize_ignored_any
    }

    fn deserialize_unit_struct<V: de::Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_unit_struct(name, visitor)
    }

    fn deserialize_newtype_struct<V: de::Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_newtype_struct(name, visitor)
    }

    fn deserialize_tuple<V: de::Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_tuple(len, visitor)
    }

    fn deserialize_tuple_struct<V: de::Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_tuple_struct(name, len, visitor)
    }

    fn deserialize_enum<V: de::Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.inner.deserialize_enum(name, variants, visitor)
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// Hands the object's members to `inner` through [`WithoutMap`].
struct WithoutVisitor<'p, V> {
    inner: V,
    path: &'p [&'static str],
}

impl<'de, V: de::Visitor<'de>> de::Visitor<'de> for WithoutVisitor<'_, V> {
    type Value = V::Value;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        self.inner.expecting(formatter)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(WithoutMap {
            inner: map,
            path: self.path,
            nested: false,
        })
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.inner.visit_seq(seq)
    }
}

/// An object's members, but for the one `path` ends at; the value of the member `path` goes
/// through (`nested`) is decoded by a [`Without`] of the rest of the path.
struct WithoutMap<'p, A> {
    inner: A,
    path: &'p [&'static str],
    nested: bool,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for WithoutMap<'_, A> {
    type Error = A::Error;

    fn next_key_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        loop {
            let Some(key) = self.inner.next_key::<Key<'de>>()? else {
                return Ok(None);
            };
            let key = key.as_str();
            match self.path {
                [last] if key == *last => {
                    self.inner.next_value::<IgnoredAny>()?;
                }
                [first, ..] => {
                    self.nested = key == *first;
                    return seed
                        .deserialize(de::value::StrDeserializer::<A::Error>::new(key))
                        .map(Some);
                }
                [] => {
                    return seed
                        .deserialize(de::value::StrDeserializer::<A::Error>::new(key))
                        .map(Some);
                }
            }
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        if std::mem::take(&mut self.nested) {
            self.inner.next_value_seed(WithoutSeed {
                inner: seed,
                path: &self.path[1..],
            })
        } else {
            self.inner.next_value_seed(seed)
        }
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

/// Decodes a member's value with a [`Without`] of the rest of the path.
struct WithoutSeed<'p, S> {
    inner: S,
    path: &'p [&'static str],
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for WithoutSeed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Without {
            inner: deserializer,
            path: self.path,
        })
    }
}

/// A member's key, borrowed from the input where it can be.
enum Key<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl Key<'_> {
    fn as_str(&self) -> &str {
        match self {
            Key::Borrowed(key) => key,
            Key::Owned(key) => key,
        }
    }
}

impl<'de> de::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> de::Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;

            fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
                formatter.write_str("a member's name")
            }

            fn visit_borrowed_str<E: de::Error>(self, key: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Borrowed(key))
            }

            fn visit_str<E: de::Error>(self, key: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(key.to_owned()))
            }

            fn visit_string<E: de::Error>(self, key: String) -> Result<Key<'de>, E> {
                Ok(Key::Owned(key))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ProxmoxMachine;
    use crate::capi;
    use kube::ResourceExt;
    use serde_json::json;

    fn machine_json() -> serde_json::Value {
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
            "kind": "ProxmoxMachine",
            "metadata": {
                "name": "m1",
                "namespace": "tenant-a",
                "managedFields": [
                    {"manager": "capmox", "operation": "Apply", "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:status": {"f:vmStatus": {}}}}
                ],
                "annotations": {"managedFields": "an annotation of that name is kept"},
                "labels": {"cluster.x-k8s.io/cluster-name": "demo"},
                "resourceVersion": "42",
                "uid": "u1"
            },
            "spec": {
                "sourceNode": "pve1",
                "templateID": 100,
                "network": {"networkDevices": [{"name": "net0", "bridge": "vmbr0"}]}
            },
            "status": {"proxmoxNode": "pve2", "vmStatus": "ready"}
        })
    }

    /// The whole object, decoded, without its managed fields.
    fn cleared<K: DeserializeOwned + Resource>(json: &serde_json::Value) -> K {
        let mut object: K = serde_json::from_value(json.clone()).unwrap();
        object.meta_mut().managed_fields = None;
        object
    }

    #[test]
    fn a_lean_object_is_the_object_without_its_managed_fields() {
        let json = machine_json();
        let text = serde_json::to_string(&json).unwrap();
        let Lean(lean): Lean<ProxmoxMachine> = serde_json::from_str(&text).unwrap();
        let full: ProxmoxMachine = cleared(&json);
        assert_eq!(
            serde_json::to_value(&lean).unwrap(),
            serde_json::to_value(&full).unwrap()
        );
        assert!(lean.metadata.managed_fields.is_none());
        assert_eq!(
            lean.metadata.annotations.unwrap()["managedFields"],
            "an annotation of that name is kept"
        );
        assert_eq!(lean.status.unwrap().proxmox_node.as_deref(), Some("pve2"));
    }

    #[test]
    fn managed_fields_anywhere_in_the_metadata_and_escaped_keys_decode_alike() {
        // Managed fields first and last among the members, and keys with escapes (which the
        // decoder cannot lend from the input).
        let text = r#"{"kind":"Machine","apiVersion":"cluster.x-k8s.io/v1beta2",
            "metadata":{"managedFields":[{"manager":"x","fieldsV1":{"f:spec":{}}}],"name":"m\u0031",
            "namespace":"ns","labels":{"cluster.x-k8s.io\/cluster-name":"demo"}},
            "spec":{"clusterName":"demo","bootstrap":{"dataSecretName":"s"}}}"#;
        let same = |text: &str| {
            let Lean(lean): Lean<capi::Machine> = serde_json::from_str(text).unwrap();
            let full: capi::Machine = cleared(&serde_json::from_str(text).unwrap());
            assert_eq!(
                serde_json::to_value(&lean).unwrap(),
                serde_json::to_value(&full).unwrap()
            );
            assert!(lean.metadata.managed_fields.is_none());
            lean
        };
        let lean = same(text);
        assert_eq!(lean.metadata.name.as_deref(), Some("m1"));
        assert_eq!(lean.labels()["cluster.x-k8s.io/cluster-name"], "demo");
        same(r#"{"metadata":{"name":"m1","managedFields":[]},"spec":{"clusterName":"demo"}}"#);
    }

    #[test]
    fn a_list_of_lean_objects_decodes_each_item_lean() {
        let list = json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha2",
            "kind": "ProxmoxMachineList",
            "metadata": {"resourceVersion": "7"},
            "items": [machine_json(), machine_json()]
        });
        let listed: kube::core::ObjectList<Lean<ProxmoxMachine>> =
            serde_json::from_value(list).unwrap();
        assert_eq!(listed.items.len(), 2);
        assert!(
            listed
                .items
                .iter()
                .all(|Lean(m)| m.metadata.managed_fields.is_none()
                    && m.spec.source_node.as_deref() == Some("pve1"))
        );
    }

    #[test]
    fn a_malformed_object_is_an_error_not_a_panic() {
        for text in [
            r#"{"metadata":"not an object","spec":{}}"#,
            r#"{"metadata":{"managedFields":[}}"#,
            r#"[1,2]"#,
            r#"null"#,
        ] {
            assert!(
                serde_json::from_str::<Lean<ProxmoxMachine>>(text).is_err(),
                "{text} decoded"
            );
        }
    }

    #[tokio::test]
    async fn a_lean_api_names_the_kind_and_namespace_of_its_own() {
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap()))
                .unwrap();
        let namespaced: Api<ProxmoxMachine> = Api::namespaced(client.clone(), "tenant-a");
        assert_eq!(api(&namespaced).resource_url(), namespaced.resource_url());
        let all: Api<ProxmoxMachine> = Api::all(client);
        assert_eq!(api(&all).resource_url(), all.resource_url());
    }
}
