"""Start-up checks: configurations that would attribute wrongly are refused or warned about before any rollout
(mask tokens that end a turn, gradient attribution past a sliding window)."""
