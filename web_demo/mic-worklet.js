// AudioWorklet: microphone → pcm16 mono 24 kHz, posted to the page in ~40 ms frames.
//
// Runs at the AudioContext's rate (`sampleRate` global). Chromium resamples the mic itself when the page makes a 24 kHz
// context; Firefox refuses to connect a mic to a context of another rate, so there the page uses a context at the
// device rate and this processor decimates to 24 kHz (box filter over each output sample's input span).
const OUT_RATE = 24000;
const FRAME = 960; // 40 ms at 24 kHz

class PcmCapture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ratio = sampleRate / OUT_RATE; // input samples per output sample
    this.pos = 0;                       // fractional input position of the next output sample's start
    this.acc = 0;                       // running sum for the current output sample
    this.accN = 0;
    this.prev = 0;
    this.frame = new Int16Array(FRAME);
    this.n = 0;
    this.sumSq = 0;
    this.enabled = true;
    this.port.onmessage = (e) => {
      if (e.data && e.data.type === 'enable') this.enabled = !!e.data.value;
      if (e.data && e.data.type === 'flush') this.flush();
    };
  }

  push(v) {
    if (v > 1) v = 1; else if (v < -1) v = -1;
    this.frame[this.n++] = v < 0 ? v * 0x8000 : v * 0x7fff;
    this.sumSq += v * v;
    if (this.n === FRAME) this.flush();
  }

  flush() {
    if (this.n === 0) return;
    const out = this.frame.slice(0, this.n);
    const rms = Math.sqrt(this.sumSq / this.n);
    this.port.postMessage({ type: 'pcm', pcm: out.buffer, rms }, [out.buffer]);
    this.n = 0;
    this.sumSq = 0;
  }

  process(inputs) {
    const input = inputs[0];
    if (!this.enabled || !input || input.length === 0) return true;
    const ch = input[0];
    if (!ch) return true;
    if (this.ratio === 1) {
      for (let i = 0; i < ch.length; i++) this.push(ch[i]);
      return true;
    }
    if (this.ratio < 1) {
      // Upsample (device slower than 24 kHz): linear interpolation between consecutive input samples.
      for (let i = 0; i < ch.length; i++) {
        const x = ch[i];
        while (this.pos < 1) {
          this.push(this.prev + (x - this.prev) * this.pos);
          this.pos += this.ratio;
        }
        this.pos -= 1;
        this.prev = x;
      }
      return true;
    }
    // Decimate: each output sample averages the input samples in [k*ratio, (k+1)*ratio).
    for (let i = 0; i < ch.length; i++) {
      this.acc += ch[i];
      this.accN += 1;
      this.pos += 1;
      if (this.pos >= this.ratio) {
        this.push(this.acc / this.accN);
        this.pos -= this.ratio;
        this.acc = 0;
        this.accN = 0;
      }
    }
    return true;
  }
}

registerProcessor('pcm-capture', PcmCapture);
