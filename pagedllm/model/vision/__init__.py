"""Vision towers of vision-language families (their encoders run at prefill, once per image)."""
