//! The pipeline: a run's plan from its options, the run itself (boot, drain, control,
//! crash dumps, the report), `report`/`convert` of a trace file and `list` of the
//! guest's events. Imports every layer below; the CLI and `bench` sit on top of it.

pub mod convert;
pub mod list;
pub mod options;
pub mod plan;
pub mod report;
pub mod run;
