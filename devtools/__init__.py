"""Development tooling, not shipped in the wheel: CPU stand-ins the tests run verl and OpenRLHF with (Ulysses
attention, a flash-attn shim, OpenRLHF's CPU platform), the float64 reference of the method the fast paths are tested
against, and the generators of docs/config.md and docs/verl.md's package map."""
