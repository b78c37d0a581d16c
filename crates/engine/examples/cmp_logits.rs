// Temporary dev tool: compare CPU logits with an oracle dump. Usage: cmp_logits MODEL OUTDIR
use lily::model::Logits;
fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let m = lily::runtime::load(lily::backend::cpu::Cpu, std::path::Path::new(&a[1]))?;
    let out = std::path::Path::new(&a[2]);
    let ids: Vec<u32> = lily::npy::read(&out.join("ids.npy"))?.data.iter().map(|&x| x as u32).collect();
    let r = lily::npy::read(&out.join("logits_f32.npy"))?;
    let mut st = m.new_state(ids.len() + 8)?;
    let mut taps = Vec::new();
    let t0 = std::time::Instant::now();
    let l = m.forward(&mut st, &ids, Logits::All, Some(&mut taps))?;
    eprintln!("forward {:.3}s", t0.elapsed().as_secs_f64());
    let v = m.cfg.vocab_size;
    let (mut mx, mut amax, mut agree) = (0f64, 0f64, 0);
    for t in 0..ids.len() {
        let (a, b) = (&l[t * v..(t + 1) * v], &r.data[t * v..(t + 1) * v]);
        for (x, y) in a.iter().zip(b) { mx = mx.max((*x as f64 - y).abs()); amax = amax.max(y.abs()); }
        let am = lily::runtime::argmax(a) as usize;
        let bm = (0..v).fold(0, |bi, i| if b[i] > b[bi] { i } else { bi });
        agree += (am == bm) as usize;
    }
    println!("max abs {mx:.3e} ref absmax {amax:.3} top1 {agree}/{}", ids.len());
    if let Ok(h) = lily::npy::read(&out.join("hidden_f32.npy")) {
        for (i, tap) in taps.iter().enumerate() {
            let n = tap.len();
            let ref_ = &h.data[i * n..(i + 1) * n];
            let e = tap.iter().zip(ref_).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
            let s = ref_.iter().map(|b| b.abs()).fold(0f64, f64::max);
            println!("layer {i}: max abs {e:.3e} (ref absmax {s:.3})");
        }
    }
    Ok(())
}
