//! The drain: the session that reads every vCPU's ring into a sink, the standby
//! drainer, the reader's scheduling priority, the guest clock's map to the host clock,
//! the output sinks and the signals that stop a drain. Imports only the VMM layer.

pub mod clock;
pub mod host_trace;
pub mod outbox;
pub mod priority;
pub mod session;
pub mod signals;
pub mod sink;
pub mod standby;
