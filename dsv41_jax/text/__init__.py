"""Text in and out: tokenizer, special tokens, chat encoding, DSML."""
