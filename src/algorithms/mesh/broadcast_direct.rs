//! Direct broadcast: the root sends its tensor to every peer at once (the transport interleaves
//! the sockets); each peer receives straight into its tensor, no staging, then confirms (so a
//! root learns of a peer that rejected the data).

use super::rooted::{self, Flow};
use crate::algorithms::Step;
use crate::error::Result;
use crate::op::Op;

pub fn run(step: &mut Step<'_>, op: &Op) -> Result<()> {
    let buf = op.outputs[0];
    rooted::exchange(step, op.root as usize, Flow::FromRoot, buf, |_| buf)
}
