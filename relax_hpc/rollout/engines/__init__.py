"""Generation engines behind one small interface (``base.Engine``)."""
