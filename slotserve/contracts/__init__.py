"""What crosses a process boundary between the parts, declared once: every part imports these."""
