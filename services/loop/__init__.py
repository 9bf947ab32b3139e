"""The loop's domain rules: policies, the lifecycle of cycles and promotions, accounting."""
