//! One trace per claim across processes: moord controller and agents export spans over
//! OTLP/gRPC to a receiver this test serves (opentelemetry-proto's collector service
//! on tonic), and a claim published and released is one trace holding the steps of the
//! controller and of both agents and every CSI call, in order.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const SECRET: &str = "s3cr3t-token-for-the-trace-test";

/// A span as received.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    trace_id: String,
    name: String,
    start: u64,
    attributes: BTreeMap<String, String>,
}

#[derive(Default, Clone)]
struct Receiver(Arc<Mutex<Vec<Received>>>);

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .map(|kv| text(kv.value.as_ref()))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(Received {
                        service: service.clone(),
                        trace_id: s.trace_id.iter().map(|b| format!("{b:02x}")).collect(),
                        name: s.name.clone(),
                        start: s.start_time_unix_nano,
                        attributes: s
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                            .collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_one_trace_across_the_controller_and_the_agents() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let receiver = Receiver::default();
    let serving = receiver.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(serving))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    let otlp = format!("--otlp-endpoint={endpoint}");
    let opts = PluginOpts {
        controller_args: vec![otlp.clone()],
        agent_args: vec![otlp],
        ..Default::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    let mut v1 = c.volume("v1", AccessMode::SingleNodeWriter);
    v1.spec.secrets = Secrets::new([("token".to_string(), SECRET.to_string())].into()).into();
    c.apply(v1).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;

    let claim = c.claim("a1", "n2").await.unwrap();
    let trace = moor::telemetry::trace_id(claim.metadata.trace.as_deref().expect("a trace"))
        .expect("a W3C traceparent");
    let (ok, out) = c.moorctl(&["describe", "claim", claim.metadata.name.as_str()]);
    assert!(ok, "{out}");
    assert!(out.contains(&format!("Trace:      {trace}")), "{out}");

    // Every CSI call of the claim's life, in order, in its trace.
    let order = [
        "ControllerPublishVolume",
        "NodeStageVolume",
        "NodePublishVolume",
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "ControllerUnpublishVolume",
    ];
    let in_trace = || -> Vec<Received> {
        let mut spans: Vec<Received> = receiver
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace)
            .cloned()
            .collect();
        spans.sort_by_key(|s| s.start);
        spans
    };
    let calls = |spans: &[Received]| -> Vec<String> {
        spans
            .iter()
            .filter(|s| order.contains(&s.name.as_str()))
            .map(|s| s.name.clone())
            .collect()
    };
    // The steps of three processes: the controller's, the attacher's (n1 hosts the
    // controller plugin) and the node's. Each process exports its spans in batches
    // on its own schedule, so the controller's may arrive after the agents' CSI calls:
    // the wait is for all of them.
    let services_wanted = ["moor-controller", "moor-agent/n1", "moor-agent/n2"];
    let steps_wanted = ["claim created", "claim", "attach", "node"];
    let complete = |spans: &[Received]| {
        let services: std::collections::BTreeSet<&str> =
            spans.iter().map(|s| s.service.as_str()).collect();
        calls(spans) == order
            && services_wanted.iter().all(|w| services.contains(w))
            && steps_wanted
                .iter()
                .all(|w| spans.iter().any(|s| s.name == *w))
    };
    let deadline = tokio::time::Instant::now() + T;
    while !complete(&in_trace()) {
        let spans = in_trace();
        assert!(
            tokio::time::Instant::now() < deadline,
            "the trace's CSI calls: {:?}; services: {:?}; steps: {:?}",
            calls(&spans),
            spans
                .iter()
                .map(|s| s.service.as_str())
                .collect::<std::collections::BTreeSet<_>>(),
            spans
                .iter()
                .map(|s| s.name.as_str())
                .collect::<std::collections::BTreeSet<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let spans = in_trace();
    // CSI spans say what they were about and how it went.
    let stage = spans.iter().find(|s| s.name == "NodeStageVolume").unwrap();
    assert_eq!(stage.attributes["code"], "Ok", "{stage:?}");
    assert!(!stage.attributes["volume"].is_empty(), "{stage:?}");
    let publish = spans
        .iter()
        .find(|s| s.name == "ControllerPublishVolume")
        .unwrap();
    assert_eq!(publish.attributes["node"], "csi-n2", "{publish:?}");
    // No CSI call of this claim is outside its trace, and no secret in any span.
    let all = receiver.0.lock().unwrap().clone();
    for s in all.iter().filter(|s| order.contains(&s.name.as_str())) {
        assert_eq!(s.trace_id, trace, "{s:?}");
    }
    for s in &all {
        for v in s.attributes.values() {
            assert!(!v.contains(SECRET), "a secret in {s:?}");
        }
    }
}
