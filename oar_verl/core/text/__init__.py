"""Text: response bytes and answer spans — token ids to bytes, final-answer patterns, answer spans and reasoning
segments as token masks (docs/method.md §2, §8)."""
