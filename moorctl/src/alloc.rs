//! `moorctl alloc stop NAME`: sets an allocation's desired status to stop; the controller
//! then releases its claims.

use moor::api::{Allocation, AllocationSpec, DesiredStatus};

use crate::{is_not_found, parse_name, parse_ns, ride_out, Ctx, Refused};

/// Stops the allocation `name` in `namespace`.
pub(crate) async fn stop(ctx: &Ctx, namespace: &str, name: &str) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("allocation", name)?;
    let key = Allocation::key_for(&ns, &name);
    let stop = |spec: &mut AllocationSpec| {
        let running = spec.desired_status != DesiredStatus::Stop;
        spec.desired_status = DesiredStatus::Stop;
        running
    };
    let outcome = ride_out(ctx, |retrying| {
        let key = &key;
        async move {
            let (_, wrote) = ctx.store.modify_spec(key, stop).await?;
            // After a lost answer, "already stopped" may be our write.
            Ok(wrote || retrying)
        }
    })
    .await;
    match outcome {
        Ok(true) => println!("allocation {name} stopped; its claims will be released"),
        Ok(false) => println!("allocation {name} already stopped"),
        Err(e) if is_not_found(&e) => {
            return Err(Refused(format!("allocation {ns}/{name} not found")).into())
        }
        Err(e) => return Err(e),
    }
    Ok(0)
}
