"""Reward functions usable as verl ``reward.custom_reward_function``s."""
