"""The app without the page: the request edge, the model cache, and the side-by-side
comparison that the Gradio page (``app.py``) wires to its widgets."""
