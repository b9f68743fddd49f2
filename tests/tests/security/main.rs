//! Tandem as an attacker would try it (issue 51): a second tenant probing the prefix cache, a
//! draft-node's certificate calling the target, a client that hangs up, a link that goes silent at
//! each kind of call, plaintext toward a node given a CA. Each module plays one of them against
//! the real binaries or an in-process cluster and asserts what the product must do;
//! `docs/security.md` says who can do what.

mod hangup;
mod links;
mod roles;
mod tenants;
