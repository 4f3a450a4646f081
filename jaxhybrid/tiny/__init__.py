"""Building the embedded default model: corpus, tokenizer, training, evaluation and its model card."""
