//! A survey's whole listings of a plugin's volumes through the typed client: every page
//! of ListVolumes, or ControllerGetVolume of each volume, checked once whole against
//! what moor expects of them ([`contract::unlisted`]): a rule over two surveys, which
//! the caller's [`contract::Expected`] carries from one to the next.

use std::collections::{BTreeMap, BTreeSet};

use super::client::Csi;
use super::contract;
use super::policy::CsiError;
use super::v1;

impl Csi {
    /// Every page of ListVolumes (LIST_VOLUMES), the entries in the plugin's order. A
    /// volume of `expected.made` this listing and the previous survey both left out is
    /// reported ([`contract::unlisted`]); a listing of 100,000 pages is refused as
    /// endless.
    pub async fn list_every_volume(
        &self,
        expected: contract::Expected<'_>,
    ) -> Result<Vec<v1::list_volumes_response::Entry>, CsiError> {
        let mut entries = Vec::new();
        let mut token = String::new();
        for _ in 0..100_000 {
            let req = v1::ListVolumesRequest {
                max_entries: 500,
                starting_token: token,
            };
            let page = self.list_volumes(req).await?;
            entries.extend(page.entries);
            if page.next_token.is_empty() {
                let ids: BTreeSet<&str> = entries
                    .iter()
                    .filter_map(|e| e.volume.as_ref().map(|v| v.volume_id.as_str()))
                    .collect();
                self.unlisted("ListVolumes", expected, |id| ids.contains(id))
                    .await;
                return Ok(entries);
            }
            token = page.next_token;
        }
        Err(CsiError {
            rpc: "ListVolumes",
            code: tonic::Code::OutOfRange,
            message: "the listing did not end after 100000 pages".into(),
            tries: 1,
        })
    }

    /// ControllerGetVolume (GET_VOLUME) of each of `ids`, for a plugin that cannot
    /// list: the answers by id, NotFound left out (any other error ends the survey). A
    /// volume of `expected.made` this survey and the previous one both did not find is
    /// reported ([`contract::unlisted`]).
    pub async fn get_every_volume(
        &self,
        ids: impl IntoIterator<Item = String>,
        expected: contract::Expected<'_>,
    ) -> Result<BTreeMap<String, v1::ControllerGetVolumeResponse>, CsiError> {
        let mut out = BTreeMap::new();
        for volume_id in ids {
            let req = v1::ControllerGetVolumeRequest {
                volume_id: volume_id.clone(),
            };
            match self.controller_get_volume(req).await {
                Ok(r) => {
                    out.insert(volume_id, r);
                }
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e),
            }
        }
        self.unlisted("ControllerGetVolume", expected, |id| out.contains_key(id))
            .await;
        Ok(out)
    }

    /// Reports, if the client is checked, each volume a whole survey by `rpc` left out
    /// twice in a row, about the volume.
    async fn unlisted(
        &self,
        rpc: &str,
        expected: contract::Expected<'_>,
        found: impl Fn(&str) -> bool,
    ) {
        let Some(monitor) = self.monitor() else {
            return;
        };
        for (vol, breach) in contract::unlisted(rpc, expected, found) {
            monitor.report(Some(vol), vec![breach]).await;
        }
    }
}
