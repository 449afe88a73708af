"""Request body -> the token ids the engine will see.

``tokenize`` (the tokenizer stage), ``pool`` (the tokenize pool off the event loop),
``prefix_cache`` (the conversation prefix cache), ``media`` (multimodal items).
"""
