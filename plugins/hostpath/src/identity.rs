//! The Identity service.

use moor_csi::v1::{
    identity_server::Identity, plugin_capability, GetPluginCapabilitiesRequest,
    GetPluginCapabilitiesResponse, GetPluginInfoRequest, GetPluginInfoResponse, PluginCapability,
    ProbeRequest, ProbeResponse,
};
use tonic::{Request, Response, Status};

use crate::calllog::Call;
use crate::{Mode, Plugin};

fn service(t: plugin_capability::service::Type) -> PluginCapability {
    PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service { r#type: t as i32 },
        )),
    }
}

#[tonic::async_trait]
impl Identity for Plugin {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        self.call(Call::new("GetPluginInfo"), async {
            Ok(GetPluginInfoResponse {
                name: self.cfg().driver_name.clone(),
                vendor_version: moor_csi::version::VERSION.to_string(),
                manifest: Default::default(),
            })
        })
        .await
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::service::Type;
        self.call(Call::new("GetPluginCapabilities"), async {
            let mut capabilities = Vec::new();
            if self.cfg().mode != Mode::Node {
                capabilities.push(service(Type::ControllerService));
                capabilities.push(service(Type::GroupControllerService));
            }
            if !self.inner.topology.is_empty() || !self.inner.segments.is_empty() {
                capabilities.push(service(Type::VolumeAccessibilityConstraints));
            }
            capabilities.push(PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(
                    plugin_capability::VolumeExpansion {
                        r#type: match self.cfg().expansion {
                            crate::Expansion::Online => {
                                plugin_capability::volume_expansion::Type::Online
                            }
                            crate::Expansion::Offline => {
                                plugin_capability::volume_expansion::Type::Offline
                            }
                        } as i32,
                    },
                )),
            });
            Ok(GetPluginCapabilitiesResponse { capabilities })
        })
        .await
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        self.call(Call::new("Probe"), async {
            Ok(ProbeResponse { ready: Some(true) })
        })
        .await
    }
}
