"""Tools for verl's multi-turn agent loop (``actor_rollout_ref.rollout.multi_turn``; docs/multi_turn.md)."""
